"""The hub's bad days, made to happen: a fault-injecting proxy (harness/checkpoints/hub_faults.py) in front of the hub
stand-in, and what huggingface_hub's `hf_hub_download` and `blockgen import hf:...` do today when a file's request is
answered 500/503, its connection is dropped mid-file, or its answer stalls past the client's timeout.

These tests pin today's behaviour, shortfalls included (issue 46, item 4), so that a change to it is seen: each
assertion says what happens now, not what should. Clients run in subprocesses with the socket guard of
tests/hub_client.py; stalls are far longer than the clients' timeouts, and nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from blockgen.harness.checkpoints.hub_faults import Drop, FaultProxy, Stall, Status
from blockgen.harness.checkpoints.hub_standin import HubStandin, publish
from test_hub_standin import FIXTURES, RELEASE, _env, _run, needs_fixtures, release_hub  # noqa: F401 - a fixture

FILE = "weights.bin"
DATA = bytes(range(256)) * 1200  # 300 kB: one chunk of huggingface_hub's 10 MB reads
# Each test sets only the timeout its stalled request meets, so no healthy request on a busy machine races a 1 s limit.
DOWNLOAD_TIMEOUT = {"HF_HUB_DOWNLOAD_TIMEOUT": "1"}
ETAG_TIMEOUT = {"HF_HUB_ETAG_TIMEOUT": "1"}
STALL_S = 120.0  # far past the 1 s timeouts; the proxy's stop ends it

# hf_hub_download of org/m's file, `sys.argv[1]` times in one process: the outcome of each (its local path's bytes
# checked against the size, or the exception's type and message).
DOWNLOAD = """
import json, sys
from huggingface_hub import hf_hub_download
out = []
for _ in range(int(sys.argv[1])):
    try:
        out.append({"path": hf_hub_download("org/m", "%s")})
    except Exception as err:
        out.append({"error": type(err).__name__, "message": str(err)})
print(json.dumps(out))
""" % FILE


@pytest.fixture
def hub(tmp_path):
    root = tmp_path / "hub"
    publish(root, "models", "org/m", {FILE: DATA})
    with HubStandin(root) as standin:
        yield standin


def download(tmp_path: Path, endpoint: str, times: int = 1, **env: str) -> tuple[list[dict], str]:
    script = tmp_path / "download.py"
    script.write_text(DOWNLOAD)
    done = _run(tmp_path, _env(tmp_path, endpoint, **env), str(script), str(times))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def cache_files(tmp_path: Path) -> dict[str, int]:
    """The hub cache's blobs and snapshot files (partial downloads included), relative path -> size."""
    cache = tmp_path / "hf" / "hub"
    return {p.relative_to(cache).as_posix(): p.stat().st_size for p in cache.glob("models--*/*/**/*") if p.is_file()
            and "/refs/" not in p.as_posix()}


def calls(proxy: FaultProxy, path: str = FILE) -> list[tuple]:
    """(method, status sent, fault kind, Range asked) of each request for `path`."""
    return [(s.method, s.status, type(s.fault).__name__ if s.fault else None, s.range) for s in proxy.requests(path)]


def test_500_then_503_on_the_metadata_are_retried_and_the_download_succeeds(hub, tmp_path):
    """The HEAD huggingface_hub sends first: a 500 makes it try again (silently), a 503 is retried after 1 s with
    one warning, then the file comes. Two lines on stderr for the second failure, none for the first."""
    faults = [Status(path=FILE, status=500), Status(path=FILE, status=503)]
    with FaultProxy(hub.endpoint, faults) as proxy:
        (got,), stderr = download(tmp_path, proxy.endpoint)
    assert Path(got["path"]).read_bytes() == DATA
    assert calls(proxy) == [("HEAD", 500, "Status", None), ("HEAD", 503, "Status", None), ("HEAD", 200, None, None),
                            ("GET", 200, None, None)]
    assert stderr.splitlines() == [f"HTTP Error 503 thrown while requesting HEAD {proxy.endpoint}/org/m/resolve/main/{FILE}",
                                   "Retrying in 1s [Retry 1/5]."]


def test_500_then_503_on_the_file_itself_each_fail_a_download(hub, tmp_path):
    """The GET of the file is retried on 408 and 429 only: a 500 and then a 503 each end a download at once with
    HfHubHTTPError (its message has the URL: endpoint and file), the third download succeeds. Nothing is logged,
    nothing is left in the cache but the snapshot folder."""
    faults = [Status(path=FILE, method="GET", status=500), Status(path=FILE, method="GET", status=503)]
    with FaultProxy(hub.endpoint, faults) as proxy:
        first, second, third = download(tmp_path, proxy.endpoint, times=3)[0]
        assert [first.get("error"), second.get("error")] == ["HfHubHTTPError", "HfHubHTTPError"]
        url = f"{proxy.endpoint}/org/m/resolve/main/{FILE}"
        assert first["message"].startswith(f"Server error '500 Internal Server Error' for url '{url}'")
        assert second["message"].startswith(f"Server error '503 Service Unavailable' for url '{url}'")
        assert Path(third["path"]).read_bytes() == DATA
    assert [c[:2] for c in calls(proxy)] == [("HEAD", 200), ("GET", 500), ("HEAD", 200), ("GET", 503), ("HEAD", 200), ("GET", 200)]


def test_a_connection_dropped_mid_file_is_fetched_again_from_the_start(hub, tmp_path):
    """Dropped after 100 of 300 kB: huggingface_hub warns and retries, without a Range (the 100 kB never left its
    10 MB read buffer), and the cache holds the whole file, byte-identical, and no partial one."""
    with FaultProxy(hub.endpoint, [Drop(path=FILE, method="GET", after_bytes=100_000)]) as proxy:
        (got,), stderr = download(tmp_path, proxy.endpoint)
    assert Path(got["path"]).read_bytes() == DATA
    assert calls(proxy) == [("HEAD", 200, None, None), ("GET", 200, "Drop", None), ("GET", 200, None, None)]
    assert "peer closed connection without sending complete message body (received 100000 bytes, expected 307200)" in stderr
    assert stderr.count("Trying to resume download...") == 1
    assert sorted(n.split("/", 2)[1] for n in cache_files(tmp_path)) == ["blobs", "snapshots"]
    assert set(cache_files(tmp_path).values()) == {len(DATA)}


def test_a_connection_dropped_past_the_first_10_mb_resumes_with_a_range(tmp_path):
    """A file over one 10 MB read, dropped after 10.5 MB: the first 10 MB are on disk, and the retry asks for the
    rest with a Range; the cached file is byte-identical."""
    big = bytes(range(256)) * (46 * 1024)  # 11.5 MiB
    publish(tmp_path / "hub", "models", "org/m", {FILE: big})
    with HubStandin(tmp_path / "hub") as hub, FaultProxy(hub.endpoint, [Drop(path=FILE, method="GET", after_bytes=11_000_000)]) as proxy:
        (got,), stderr = download(tmp_path, proxy.endpoint)
    assert Path(got["path"]).read_bytes() == big
    assert calls(proxy) == [("HEAD", 200, None, None), ("GET", 200, "Drop", None), ("GET", 206, None, "bytes=10485760-")]
    assert stderr.count("Trying to resume download...") == 1


def test_a_connection_dropped_on_every_try_fails_and_a_healthy_rerun_completes(hub, tmp_path):
    """Dropped six times (the first try and five retries): RemoteProtocolError, whose message names neither the
    file nor the endpoint (the warnings before it name the URL), and nothing of the file in the cache. The next
    download, with the proxy passing everything, fetches the whole file."""
    with FaultProxy(hub.endpoint, [Drop(path=FILE, method="GET", after_bytes=100_000, count=6)]) as proxy:
        (failed,), stderr = download(tmp_path, proxy.endpoint)
        assert failed["error"] == "RemoteProtocolError"
        assert failed["message"] == "peer closed connection without sending complete message body (received 100000 bytes, expected 307200)"
        assert stderr.count("Trying to resume download...") == 5 and stderr.count("Max retries exceeded.") == 1
        assert cache_files(tmp_path) == {}  # no partial blob, no snapshot file
        (again,), stderr = download(tmp_path, proxy.endpoint)
    assert Path(again["path"]).read_bytes() == DATA
    assert [c[1:] for c in calls(proxy) if c[0] == "GET"] == [(200, "Drop", None)] * 6 + [(200, None, None)]
    assert {n.split("/", 2)[1]: size for n, size in cache_files(tmp_path).items()} == {"blobs": len(DATA), "snapshots": len(DATA)}


def test_a_stalled_metadata_request_is_retried_silently(hub, tmp_path):
    """The HEAD stalls once: after HF_HUB_ETAG_TIMEOUT=1 huggingface_hub asks again (with its own 60 s timeout,
    not the variable's) and the download succeeds, with nothing on stderr."""
    with FaultProxy(hub.endpoint, [Stall(path=FILE, method="HEAD", seconds=STALL_S)]) as proxy:
        (got,), stderr = download(tmp_path, proxy.endpoint, **ETAG_TIMEOUT)
    assert Path(got["path"]).read_bytes() == DATA and stderr == ""
    # the stalled HEAD is recorded last: its record is written when the proxy's stop ends the stall
    assert calls(proxy) == [("HEAD", 200, None, None), ("GET", 200, None, None), ("HEAD", None, "Stall", None)]


def blockgen_import(tmp_path: Path, endpoint: str, **env: str):
    return _run(tmp_path, _env(tmp_path, endpoint, **env), "blockgen", "import", f"hf:jdeschena/blockgen/{RELEASE}",
                "--tokenizer", "gpt2", "--out-dir", str(tmp_path / "out"))


@needs_fixtures
def test_blockgen_import_survives_a_dropped_connection_and_a_busy_metadata_answer(release_hub, tmp_path):
    """A 503 on the weights' HEAD and their connection dropped halfway: the import completes, the cached weights are
    the release's bytes, and stderr has the client's two lines about the drop, nothing about the 503."""
    weights = f"{RELEASE}/model.safetensors"
    faults = [Status(path=weights, method="HEAD", status=503), Drop(path=weights, method="GET", after_bytes=300_000)]
    with FaultProxy(release_hub.endpoint, faults) as proxy:
        done = blockgen_import(tmp_path, proxy.endpoint)
    assert done.returncode == 0, done.stderr
    # the first failed HEAD is retried without a word; the drop is one warning
    assert "503" not in done.stderr and done.stderr.count("Trying to resume download...") == 1, done.stderr
    assert [c[:3] for c in calls(proxy, weights)] == [("HEAD", 503, "Status"), ("HEAD", 200, None), ("GET", 200, "Drop"),
                                                      ("GET", 200, None)]
    cached = [p.read_bytes() for p in (tmp_path / "hf" / "hub").rglob("snapshots/*/**/model.safetensors")]
    assert cached == [(FIXTURES / RELEASE / "model.safetensors").read_bytes()]


@needs_fixtures
def test_blockgen_import_asks_again_after_a_500_then_a_503_on_the_weights(release_hub, tmp_path):
    """huggingface_hub retries a download's GET on 408 and 429 only; `blockgen import` asks again after a 5xx
    (`hub_call` with `answered_busy`, 2 s then 4 s): a 500 then a 503 on the weights, and the import completes, each
    retry one warning line naming the file and the endpoint."""
    weights = f"{RELEASE}/model.safetensors"
    faults = [Status(path=weights, method="GET", status=500), Status(path=weights, method="GET", status=503)]
    with FaultProxy(release_hub.endpoint, faults) as proxy:
        done = blockgen_import(tmp_path, proxy.endpoint)
    assert done.returncode == 0, done.stderr
    retries = [line for line in done.stderr.splitlines() if "trying again in" in line]
    assert len(retries) == 2 and all(f"{weights} from {proxy.endpoint}: HfHubHTTPError" in line for line in retries), done.stderr
    assert "500 Internal Server Error" in retries[0] and "(try 2 of 3)" in retries[0] and "503" in retries[1]
    assert [c[:2] for c in calls(proxy, weights)] == [("HEAD", 200), ("GET", 500), ("HEAD", 200), ("GET", 503), ("HEAD", 200), ("GET", 200)]
    cached = [p.read_bytes() for p in (tmp_path / "hf" / "hub").rglob("snapshots/*/**/model.safetensors")]
    assert cached == [(FIXTURES / RELEASE / "model.safetensors").read_bytes()]


@needs_fixtures
def test_blockgen_import_of_a_stalled_download_names_the_file_and_the_endpoint(release_hub, tmp_path):
    """The weights stall past HF_HUB_DOWNLOAD_TIMEOUT=1 on every try: huggingface_hub tries six times (a warning naming
    the URL each time) and raises httpx's ReadTimeout, whose message is only "timed out"; the import's one error line
    names the release, the file and the endpoint, and the offline fix. Nothing of the weights is left in the cache."""
    weights = f"{RELEASE}/model.safetensors"
    with FaultProxy(release_hub.endpoint, [Stall(path=weights, method="GET", seconds=STALL_S, count=10)]) as proxy:
        done = blockgen_import(tmp_path, proxy.endpoint, **DOWNLOAD_TIMEOUT)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"blockgen import: error: could not fetch hf:jdeschena/blockgen/{RELEASE}"), last
    assert last.endswith(f"(ReadTimeout fetching {weights} from {proxy.endpoint}: timed out)"), last
    assert "make demo" in last
    assert done.stderr.count(f"Error while downloading from {proxy.endpoint}/jdeschena/blockgen/resolve/main/{weights}: timed out") == 6
    assert [c[:3] for c in calls(proxy, weights)] == [("HEAD", 200, None)] + [("GET", None, "Stall")] * 6
    assert not list((tmp_path / "hf" / "hub").rglob("model.safetensors"))


@pytest.mark.skipif(not (FIXTURES.parent / "released").is_dir(), reason=f"release fixtures not found at {FIXTURES.parent}")
def test_the_hub_gone_in_the_middle_of_a_sweep_keeps_its_finished_settings(tmp_path):
    """`blockgen sweep released-owt --keep-going` of two releases, the hub going down at the first request for the second:
    the first release's settings finish and are kept, each of the second's is recorded in error.json with the file and
    the endpoint, no cache holds a partial file; the rerun against a healthy hub skips the first and runs the second."""
    from blockgen.harness.checkpoints.hub_faults import Down
    from blockgen.harness.data.hub_standin_repos import write_tiny_hub

    write_tiny_hub(tmp_path / "hub", release_fixtures=FIXTURES.parent)
    second = "blockgen/multi_block_size/16/owt/0.05_0.95/absorb"  # owt-masked-mix's subfolder
    sweep = ["blockgen", "sweep", "released-owt", "--runs", str(tmp_path / "runs"), "--models", "ar", "masked-mix",
             "--device", "cpu", "--temperatures", "1.0", "--limit", "2", "--keep-going", "--no-progress",
             "--metadata", '{"scorer": "transformers"}']  # the in-process scorer: this test is about the hub

    def report(done) -> dict:
        return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("sweep: "))[7:])

    results, mauve = tmp_path / "runs" / "results" / "released", tmp_path / "mauve-cache"
    with HubStandin(tmp_path / "hub") as standin:
        with FaultProxy(standin.endpoint, [Down(path=second)]) as proxy:
            gone = _run(tmp_path, _env(tmp_path, proxy.endpoint, OMP_NUM_THREADS="1", BLOCKGEN_MAUVE_CACHE=str(mauve)), *sweep)
        assert gone.returncode == 1, gone.stderr[-3000:]
        assert report(gone) | {"seconds": 0} == {"settings": 8, "ran": 3, "skipped": 0, "model_loads": 1, "vllm_starts": 0,
                                                  "scorer_loads": 1, "seconds": 0, "failed": report(gone)["failed"], "shard": None}
        assert len(report(gone)["failed"]) == 5 and all(f.startswith("released/owt-masked-mix/") for f in report(gone)["failed"])
        assert len(list((results / "owt-ar").rglob("results_*.json"))) == 3
        errors = sorted((results / "owt-masked-mix").rglob("error.json"))
        assert len(errors) == 5
        message = json.loads(errors[0].read_text())["error"]
        assert f"{second}/config.json from {proxy.endpoint}" in message and "HF_HUB_OFFLINE=1" in message, message
        assert not [p for p in (tmp_path / "hf").rglob("*.incomplete")]  # no partial download in the hub or datasets cache
        assert list(mauve.iterdir()) and not list(mauve.rglob(".*.tmp"))  # the references' features, written whole
        converted = [p for p in (tmp_path / "release-cache").iterdir()]
        assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file(), converted  # owt-ar's, whole

        healthy = _run(tmp_path, _env(tmp_path, standin.endpoint, OMP_NUM_THREADS="1", BLOCKGEN_MAUVE_CACHE=str(mauve)), *sweep)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    assert (report(healthy)["ran"], report(healthy)["skipped"], report(healthy)["failed"]) == (5, 3, [])
    assert not list(results.rglob("error.json"))
    assert len(list(results.rglob("results_*.json"))) == 8


def test_training_data_and_tokenizer_through_a_busy_and_dropping_hub(tmp_path):
    """`blockgen prepare-data --preset owt-ar` online (datasets' parquet shards of OWT's export, gpt2's tokenizer) with
    gpt2's tokenizer.json answered 500 once, the first shard 503 twice and the second dropped after 2,000 bytes: the
    project asks again for the tokenizer and the dataset (one warning per retry), huggingface_hub fetches the dropped
    shard again; the prepared data equals a healthy run's, byte for byte, and no cache holds a partial file."""
    from blockgen.harness.data.hub_standin_repos import write_tiny_hub

    write_tiny_hub(tmp_path / "hub")

    def prepare(endpoint: str, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        cache = tmp_path / name
        env = _env(cache, endpoint, OMP_NUM_THREADS="1")
        done = _run(tmp_path, env, "blockgen", "prepare-data", "--preset", "owt-ar", "--size", "micro", "--seq-len", "64",
                    "--data.cache-dir", str(cache / "data"))
        assert done.returncode == 0, done.stderr[-3000:]
        (prepared,) = (cache / "data").glob("prepared-owt-*")
        return done, prepared

    faults = [Status(path="/tokenizer.json", method="GET", status=500), Status(path="0000.parquet", method="GET", status=503, count=2),
              Drop(path="0001.parquet", method="GET", after_bytes=2000)]
    with HubStandin(tmp_path / "hub") as standin:
        with FaultProxy(standin.endpoint, faults) as proxy:
            faulty, faulty_data = prepare(proxy.endpoint, "faulty")
        healthy, healthy_data = prepare(standin.endpoint, "healthy")
    assert [s.status for s in proxy.requests("/tokenizer.json", "GET")] == [500, 200]
    assert [s.status for s in proxy.requests("0000.parquet", "GET")] == [503, 503, 200]
    shard = proxy.requests("0001.parquet", "GET")
    # fetched again from the start: under 10 MB, the client's read buffer, it asks for no Range (the test above)
    assert [(type(s.fault).__name__ if s.fault else None, s.range) for s in shard] == [("Drop", None), (None, None)]
    retries = [line for line in faulty.stderr.splitlines() if "trying again in" in line]
    assert len(retries) == 3 and sum("Skylion007/openwebtext" in line for line in retries) == 2, retries
    assert "Trying to resume download" in faulty.stderr
    files = sorted(p.relative_to(faulty_data) for p in faulty_data.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(healthy_data) for p in healthy_data.rglob("*") if p.is_file())
    assert all((faulty_data / f).read_bytes() == (healthy_data / f).read_bytes() for f in files if f.name != "meta.json")
    assert not list((tmp_path / "faulty" / "hf").rglob("*.incomplete"))
