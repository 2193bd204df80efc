"""Converting a release once into a checkpoint of this harness (`import_release`), and `resolve`, which
every loader of checkpoints takes a release through. The release is found locally, under
$BLOCKGEN_RELEASE_DIR or on the hub (`locate`); the architecture comes from config.json, the vocabulary
from the embedding's rows, the weights are renamed and the tokenizer (with the authors' `[PAD]` rule) is
saved beside them; the result is an ordinary checkpoint directory in a cache, whose config.json records
the source (`training.source`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from blockgen.harness.checkpoints.checkpoint import CONFIG, WEIGHTS, save_checkpoint
from blockgen.harness.checkpoints.hub import OFFLINE_HINT, HubUnavailableError, answered_busy, file_id, hub_call
from blockgen.harness.checkpoints.release_paths import (
    DATASETS,
    HF_PREFIX,
    HUB_REPO,
    ReleaseError,
    ReleaseOverrides,
    fetch_hint,
    merge_overrides,
    parse_release_path,
    read_release_path,
    split_hf,
)
from blockgen.harness.checkpoints.release_vocab import release_tokenizer
from blockgen.harness.checkpoints.release_weights import map_weights, release_config, rename, vocab_rows
from blockgen.models.model import BlockGen

# Where `hf:jdeschena/blockgen/<subfolder>` is looked up before the hub: <dir>/<subfolder>.
LOCAL_DIR_ENV = "BLOCKGEN_RELEASE_DIR"
CACHE_ENV = "BLOCKGEN_RELEASE_CACHE"  # converted checkpoints (default ~/.cache/blockgen/released)


def _read_config(folder: Path) -> tuple[dict | None, str]:
    """(config.json, "") when it is the authors' (a `type`, no `model_type`), else (what was read, or
    None, and why it is not a release's)."""
    path = folder / CONFIG
    if not path.is_file():
        return None, f"{path}: missing"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path}: not valid JSON ({err})"
    if not isinstance(raw, dict):
        return None, f"{path}: a JSON {type(raw).__name__}, not an object"
    if "model_type" in raw or raw.get("type") not in ("block-dit", "dit"):
        return raw, f"{path}: type={raw.get('type')!r}, expected the authors' 'block-dit' or 'dit'"
    return raw, ""


def is_release_spec(pretrained: str | Path) -> bool:
    """`hf:...`, or a local folder whose config.json is the authors'."""
    text = str(pretrained)
    return text.startswith(HF_PREFIX) or not _read_config(Path(text))[1]


def offline_message(spec: str, subfolder: str, repo: str = HUB_REPO) -> str:
    return (f"could not fetch {spec} ({repo}, subfolder {subfolder}). With a local copy, run offline: "
            f"`huggingface-cli download {repo} --include '{subfolder}/*' --local-dir DIR`, then either "
            f"pretrained=DIR/{subfolder} or {LOCAL_DIR_ENV}=DIR HF_HUB_OFFLINE=1 with pretrained={spec}. "
            f"Without the hub: {OFFLINE_HINT}")


def locate(pretrained: str | Path) -> tuple[Path, str]:
    """(local folder holding config.json and model.safetensors, source as recorded in results)."""
    text = str(pretrained)
    if not text.startswith(HF_PREFIX):
        folder = Path(text)
        for name in (CONFIG, WEIGHTS):
            if not (folder / name).is_file():
                raise ReleaseError(f"{folder / name}: missing (a release folder holds {CONFIG} and {WEIGHTS}); "
                                   f"fix: {fetch_hint(parse_release_path(folder).subfolder)}")
        return folder, str(folder.resolve())
    repo, subfolder = split_hf(text)
    setting, problem = read_release_path(subfolder)
    if repo == HUB_REPO and setting.algo is None:  # the hub holds the layout's subfolders only
        raise ReleaseError(f"{text}: {problem or 'no baselines/... or blockgen/... subfolder'}; fix: the hub's "
                           f"subfolders are listed by `blockgen released names`")
    local = os.environ.get(LOCAL_DIR_ENV)
    if local and all((Path(local) / subfolder / n).is_file() for n in (CONFIG, WEIGHTS)):
        return Path(local) / subfolder, text
    from huggingface_hub import constants, hf_hub_download

    paths = []
    for name in (CONFIG, WEIGHTS):
        fetching = f"{subfolder}/{name} from {constants.ENDPOINT}"
        try:  # a busy hub's 5xx asked again (huggingface_hub retries a failed connection itself, not a 500 on a file)
            paths.append(hub_call(lambda: hf_hub_download(repo, name, subfolder=subfolder), fetching, hint="",
                                  retry_if=answered_busy))
        except Exception as err:  # offline, DNS, 404, a timeout, a missing cache entry under HF_HUB_OFFLINE=1
            cause = err.__cause__ if isinstance(err, HubUnavailableError) and err.__cause__ is not None else err
            reason = " ".join(str(cause).split())  # hub errors span lines: the message stays one
            # the client's own message may be as short as "timed out": say which file, from where
            raise HubUnavailableError(f"{_login_hint(cause)}{offline_message(text, subfolder, repo)} ({type(cause).__name__} "
                                      f"fetching {fetching}: {reason})") from err
    return Path(paths[0]).parent, text


def _login_hint(err: BaseException) -> str:
    """For a repository the hub gates: the two ways on, before the offline ones."""
    from huggingface_hub.errors import GatedRepoError

    if not isinstance(err, GatedRepoError):
        return ""
    return ("the repository is gated: log in with an account that has access (`huggingface-cli login`, or HF_TOKEN), "
            "or use a local copy. ")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "blockgen" / "released")


def import_release(pretrained: str | Path, overrides: ReleaseOverrides = ReleaseOverrides(), out_dir: str | Path | None = None) -> Path:
    """Convert a release once into a checkpoint directory of this project (cached; returns its path).

    `out_dir` None: a folder under `cache_root()` keyed by the release files, the setting and the
    tokenizer, reused when it exists. The source is recorded under config.json's `training.source`.
    """
    from blockgen.harness.checkpoints.checkpoint import read_weights
    from blockgen.harness.checkpoints.tokenizer import special_tokens

    folder, source = locate(pretrained)
    text = str(pretrained)
    path_setting, problem = read_release_path(text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else folder)
    raw, config_problem = _read_config(folder)
    if config_problem:
        raise ReleaseError(f"{config_problem}; fix: {fetch_hint(path_setting.subfolder)}")
    setting = merge_overrides(path_setting, overrides, source, problem)
    tokenizer_name = overrides.tokenizer or setting.tokenizer
    if tokenizer_name is None:
        raise ReleaseError(f"{source}: the path names no dataset with a known tokenizer ({sorted(DATASETS)}); "
                           f"fix: tokenizer=<directory or hub name>")
    key = hashlib.sha256(json.dumps([file_id(folder / CONFIG), file_id(folder / WEIGHTS), asdict(setting), source,
                                     _tokenizer_id(tokenizer_name)]).encode()).hexdigest()[:20]
    target = Path(out_dir) if out_dir is not None else cache_root() / key
    if out_dir is None and (target / CONFIG).is_file() and (target / WEIGHTS).is_file():
        return target
    weights = read_weights(folder / WEIGHTS, fetch_hint(setting.subfolder), ReleaseError)
    rows = vocab_rows(weights, source)
    tokenizer = release_tokenizer(tokenizer_name, rows, setting, source, given=overrides.tokenizer is not None,
                                  prior_free=setting.algo == "blockgen" and path_setting.prior is None)
    config = release_config(raw, weights, setting, source, special_tokens(tokenizer).to_dict())
    state = map_weights(weights, config.shape.d_model // config.shape.n_heads, source)
    model = BlockGen(config)
    expected = model.state_dict()

    def authors(key: str) -> str:
        return rename(key, to_project=False) or key

    problems = [f"{authors(k)} is {list(state[k].shape)}, expected {list(expected[k].shape)}"
                for k in sorted(expected.keys() & state.keys()) if expected[k].shape != state[k].shape]
    problems += [f"{authors(k)} {list(expected[k].shape)} is missing" for k in sorted(expected.keys() - state.keys())]
    problems += [f"{authors(k)} is not expected" for k in sorted(state.keys() - expected.keys())]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ReleaseError(f"{source}/{WEIGHTS}: does not fit {CONFIG} ({setting.algo}, prior {setting.prior}): "
                           f"{'; '.join(problems[:4])}{more}; fix: {fetch_hint(setting.subfolder)}")
    model.load_state_dict(state)
    extra = {"source": source, "release": {**asdict(setting), "tokenizer": tokenizer_name, "config": raw}}
    if out_dir is not None:
        return save_checkpoint(target, model, tokenizer, extra=extra)
    # Several processes (torchrun ranks) may import the same release at once: each writes its own
    # folder and the first rename wins; the others' identical copies are dropped.
    mine = save_checkpoint(target.with_name(f"{target.name}.{os.getpid()}"), model, tokenizer, extra=extra)
    try:
        os.rename(mine, target)
    except OSError:
        shutil.rmtree(mine, ignore_errors=True)
    return target


def _tokenizer_id(name: str) -> str:
    """A local tokenizer folder's content identifies it (a hub name identifies itself)."""
    path = Path(name)
    if not path.is_dir():
        return name
    h = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(file.name.encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def resolve(pretrained: str | Path, overrides: ReleaseOverrides = ReleaseOverrides()) -> Path:
    """The checkpoint directory to load for `pretrained`: a release is imported (once), a checkpoint of
    this project is returned as it is (release overrides on it are an error)."""
    if is_release_spec(pretrained):
        return import_release(pretrained, overrides)
    names = sorted([*overrides.given(), *(["tokenizer"] if overrides.tokenizer else [])])
    if not names:
        return Path(pretrained)
    raw, problem = _read_config(Path(pretrained))
    if raw is not None and raw.get("model_type") == "blockgen":
        raise ReleaseError(f"pretrained={pretrained} is a checkpoint of this project: {names} apply to released "
                           f"checkpoints only (hf:{HUB_REPO}/<subfolder> or a release folder); fix: drop them")
    raise ReleaseError(f"{problem}; {names} take a release folder, which holds the authors' {CONFIG} beside {WEIGHTS}; "
                       f"fix: {fetch_hint(parse_release_path(pretrained).subfolder)}")


def resolve_model_args(model_args: dict) -> Path:
    """`resolve` from lm-eval's model args (what tasks receive as metadata): `pretrained` and the
    release overrides (tokenizer, algo, prior, block_sizes, block_weights, x0_causal); other keys ignored."""
    keys = ("algo", "prior", "block_sizes", "block_weights", "x0_causal", "tokenizer")
    overrides = ReleaseOverrides.from_model_args(**{k: model_args.get(k) for k in keys})
    return resolve(model_args["pretrained"], overrides)


def resolve_with_tokenizer(pretrained: str | Path, tokenizer) -> Path:
    """`resolve` for a caller that holds a tokenizer (training's `init_from`): a release whose path
    names no tokenizer is read with this one."""
    if not is_release_spec(pretrained):
        return Path(pretrained)
    text = str(pretrained)
    setting = parse_release_path(text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else text)
    if setting.tokenizer is not None:
        return import_release(pretrained)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return import_release(pretrained, ReleaseOverrides(tokenizer=folder))


def release_source(checkpoint: str | Path) -> str | None:
    """The release a converted checkpoint came from (config.json `training.source`), else None."""
    try:
        return json.loads((Path(checkpoint) / CONFIG).read_text())["training"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
