"""Data preparation cost: rows/s and peak memory of `blockgen prepare-data` at two sizes, side by side.

Synthetic files of the real schemas (TinyGSM: `question`, `code`; OWT: `text`) as parquet, prepared
in a fresh process each (harness/data/prepare.py: the same code as `blockgen prepare-data`) with a BPE
trained locally (no hub; the real tokenizers, SmolLM-135M's and GPT-2's, may be faster or slower).
Peak memory: the process's peak RSS (ru_maxrss, which includes the memory-mapped Arrow pages that
the page cache can drop) and its peak anonymous RSS (sampled every 5 ms: memory that cannot be dropped).
The last lines extrapolate the rate to full TinyGSM (11.8M rows) and OWT (8.0M documents).

    .venv/bin/python bench/bench_prepare.py                       # 250k and 1M TinyGSM rows, 4k and 16k OWT documents
    .venv/bin/python bench/bench_prepare.py --rows 20000 80000 --docs 1000 4000   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL_TINYGSM_ROWS = 11_800_000
FULL_OWT_DOCS = 8_013_769
OWT_TOKENS = 9.0e9  # GPT-2 tokens of OWT (about 1,120 per document)

PROBE = """
import json, resource, sys, threading, time
from blockgen.harness.data.sources import DataConfig
from blockgen.harness.data.prepare import prepare_data

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

peak = [anon_kb()]
def sample():
    while True:
        peak[0] = max(peak[0], anon_kb()); time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
source, path, tok, cache, seq_len = sys.argv[1:6]
start = time.perf_counter()
directory = prepare_data(DataConfig(source=source, path=path, tokenizer=tok, cache_dir=cache), int(seq_len), log=lambda *a: None)
seconds = time.perf_counter() - start
meta = json.loads((directory / "meta.json").read_text())
print(json.dumps({"seconds": seconds, "peak_anon_mb": max(peak[0], anon_kb()) / 1024,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "examples": meta["train_examples"] + meta["validation_examples"]}))
"""


def write_tinygsm(path: Path, rows: int) -> None:
    """TinyGSM-schema rows from the word-problem generator (source 'wordproblems') (questions and Python programs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from blockgen.harness.data.wordproblems import generate, to_records

    chunk = 10_000  # one parquet row group per chunk (the reader holds a row group at a time)
    records = to_records(generate("train", chunk, seed=0))
    with pq.ParquetWriter(path, pa.schema([("question", pa.string()), ("code", pa.string())])) as writer:
        for start in range(0, rows, chunk):
            part = records[: min(chunk, rows - start)]  # the same problems repeated: tokenizer speed is what matters
            writer.write_table(pa.table({"question": [r["question"] for r in part], "code": [r["code"] for r in part]}))


def write_owt(path: Path, docs: int, rng: np.random.Generator) -> None:
    """OWT-schema documents of about 4,800 characters (OWT's mean: about 1,120 GPT-2 tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics)).split()
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for start in range(0, docs, 2_000):
            n = min(2_000, docs - start)
            offsets = rng.integers(0, len(text) - 900, n)
            writer.write_table(pa.table({"text": [" ".join(text[o : o + 800]) for o in offsets]}))


def measure(source: str, path: Path, tok: str, work: Path, seq_len: int) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / f"hf-{path.stem}"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, source, str(path), tok, str(work / f"cache-{path.stem}"), str(seq_len)],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs=2, default=[250_000, 1_000_000], help="TinyGSM-schema rows, two sizes")
    parser.add_argument("--docs", type=int, nargs=2, default=[4_000, 16_000], help="OWT-schema documents, two sizes")
    parser.add_argument("--vocab", type=int, default=8192, help="the local BPE's vocabulary")
    args = parser.parse_args()

    from blockgen.harness.checkpoints.tokenizer import train_bpe
    from blockgen.harness.data.wordproblems import generate

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        problems = generate("train", 20_000, seed=0)
        from pydoc_data.topics import topics

        tok = work / "bpe"
        train_bpe([p.question for p in problems] + [p.code for p in problems] + list(topics.values()), args.vocab, tok)
        rows = {}
        for n in args.rows:
            write_tinygsm(work / f"tinygsm-{n}.parquet", n)
            rows[("tinygsm", n)] = measure("tinygsm", work / f"tinygsm-{n}.parquet", str(tok), work, 512)
        rng = np.random.default_rng(0)
        for n in args.docs:
            write_owt(work / f"owt-{n}.parquet", n, rng)
            rows[("owt", n)] = measure("owt", work / f"owt-{n}.parquet", str(tok), work, 1024)

    cores = len(os.sched_getaffinity(0))
    print(f"# blockgen prepare-data on synthetic parquet, local BPE ({args.vocab} tokens), {cores} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'source':8} {'rows':>10} {'seconds':>8} {'rows/s':>9} {'peak RSS MB':>12} {'peak anon MB':>13} {'examples':>10}")
    for (source, n), r in rows.items():
        print(f"{source:8} {n:>10} {r['seconds']:>8.1f} {n / r['seconds']:>9.0f} {r['maxrss_mb']:>12.0f} {r['peak_anon_mb']:>13.0f} {r['examples']:>10}")
    for source, sizes, full, unit in (("tinygsm", args.rows, FULL_TINYGSM_ROWS, "rows"), ("owt", args.docs, FULL_OWT_DOCS, "documents")):
        small, large = rows[(source, sizes[0])], rows[(source, sizes[1])]
        rate = sizes[1] / large["seconds"]
        print(f"{source}: {sizes[1] / sizes[0]:.0f}x the {unit}: peak anon x{large['peak_anon_mb'] / small['peak_anon_mb']:.2f}, "
              f"peak RSS x{large['maxrss_mb'] / small['maxrss_mb']:.2f}; at {rate:.0f} {unit}/s, full size ({full:,} {unit}) "
              f"takes about {full / rate / 3600:.1f} h on these cores")
    print(f"owt: {OWT_TOKENS:.1e} GPT-2 tokens as int32 chunks of 1,024 take about {OWT_TOKENS * 4 / 2**30:.0f} GiB of disk")


if __name__ == "__main__":
    main()
