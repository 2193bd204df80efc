"""lm-eval's own task index kept on disk (blockgen/lm_eval/task_index.py) against the index lm-eval builds."""

import inspect
import logging
import pickle
import types
from pathlib import Path

import pytest
from lm_eval.tasks import _index

from blockgen.lm_eval import task_index

LM_EVAL_BUILD = inspect.unwrap(_index.TaskIndex.build)  # lm-eval's own, whether or not the start-up hook wrapped it


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture()
def folders(tmp_path, monkeypatch):
    """A stand-in for lm-eval's task folder (two tasks, a group, a tag, an include), a user's folder that overrides
    one of its tasks, a cache folder, and a module like `lm_eval.tasks._index` whose TaskIndex is wrapped."""
    builtin, user, cache = tmp_path / "lm_eval_tasks", tmp_path / "user", tmp_path / "cache"
    _write(builtin, "base.yaml", "output_type: generate_until\ndoc_to_text: '{{q}}'\n")
    _write(builtin, "arc/easy.yaml", "include: ../base.yaml\ntask: arc_easy\ntag: [arc]\ndoc_to_target: !function utils.t\n")
    _write(builtin, "arc/hard.yaml", "task: arc_hard\ntag: arc\n")
    _write(builtin, "group.yaml", "group: both\ntask: [arc_easy, arc_hard]\n")
    _write(builtin, "__pycache__/skipped.yaml", "task: skipped\n")
    _write(user, "mine.yaml", "task: arc_hard\ndoc_to_text: mine\n")
    _write(user, "new.yaml", "task: new_task\n")
    monkeypatch.setenv(task_index.CACHE_ENV, str(cache))
    monkeypatch.setattr(task_index, "_MEMORY", {})

    class TaskIndex(_index.TaskIndex):
        build = staticmethod(LM_EVAL_BUILD)

    module = types.SimpleNamespace(__file__=str(builtin / "_index.py"), __name__="lm_eval.tasks._index",
                                   TaskIndex=TaskIndex)
    task_index.cache_builtin_index(module)
    return types.SimpleNamespace(builtin=builtin, user=user, cache=cache, build=TaskIndex.build)


def test_the_cached_index_is_the_index_lm_eval_builds(folders, caplog):
    """Cold (built and stored), warm from memory, warm from disk: each equal to lm-eval's own build of the same
    folders, the user's task overriding the built-in one with lm-eval's warning."""
    paths = [folders.builtin, folders.user]
    with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
        expected = LM_EVAL_BUILD(paths)
    assert expected["arc_hard"].yaml_path == folders.user / "mine.yaml" and "new_task" in expected
    assert expected["arc_easy"].cfg["doc_to_text"] == "{{q}}" and "skipped" not in expected
    override = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    caplog.clear()

    with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
        cold = folders.build(paths)
    assert cold == expected
    assert [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()] == override
    assert [p.name.startswith(task_index.PREFIX) for p in folders.cache.iterdir()] == [True]

    cold["arc_easy"].cfg["doc_to_text"] = "changed by a caller"  # a caller's change stays in its copy
    assert folders.build(paths) == expected
    task_index._MEMORY.clear()
    assert folders.build(paths) == expected
    assert folders.build([folders.builtin]) == LM_EVAL_BUILD([folders.builtin])


def test_a_changed_task_file_builds_the_index_anew(folders):
    """Edited, added or removed YAML files change the key; the old index file is replaced, not kept beside."""
    folders.build([folders.builtin])
    first = {p.name for p in folders.cache.iterdir()}
    path = _write(folders.builtin, "arc/hard.yaml", "task: arc_hard\ntag: arc\ndoc_to_text: edited\n")
    assert folders.build([folders.builtin])["arc_hard"].cfg["doc_to_text"] == "edited"
    _write(folders.builtin, "more/extra.yaml", "task: extra\n")
    assert "extra" in folders.build([folders.builtin])
    path.unlink()
    rebuilt = folders.build([folders.builtin])
    assert "arc_hard" not in rebuilt and rebuilt == LM_EVAL_BUILD([folders.builtin])
    files = {p.name for p in folders.cache.iterdir()}
    assert len(files) == 1 and files != first


def test_off_unwritable_or_other_folders_build_as_lm_eval_does(folders, monkeypatch, tmp_path):
    """`0` turns the cache off; a cache path that cannot be a folder (a file) only costs the build; a first folder
    that is not lm-eval's, or `resolve_includes=False`, never touches the cache."""
    expected = LM_EVAL_BUILD([folders.builtin, folders.user])
    monkeypatch.setenv(task_index.CACHE_ENV, "0")
    assert folders.build([folders.builtin, folders.user]) == expected
    blocked = _write(tmp_path, "a-file", "")
    monkeypatch.setenv(task_index.CACHE_ENV, str(blocked))
    assert folders.build([folders.builtin, folders.user]) == expected
    monkeypatch.setenv(task_index.CACHE_ENV, str(folders.cache))
    assert folders.build([folders.user]) == LM_EVAL_BUILD([folders.user])
    assert folders.build([folders.builtin], resolve_includes=False) == LM_EVAL_BUILD([folders.builtin],
                                                                                    resolve_includes=False)
    assert not folders.cache.exists()


def test_lm_evals_real_index_survives_the_cache(tmp_path, monkeypatch):
    """lm-eval's real task folder (about 14,000 YAML files): its index read back from the cache file equals the
    index as built, and the installed hook serves it to a TaskManager with this project's tasks after it."""
    monkeypatch.setenv(task_index.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(task_index, "_MEMORY", {})
    root = Path(_index.__file__).parent.resolve()
    built = LM_EVAL_BUILD([root])
    assert len(built) > 1000
    from importlib.metadata import version

    task_index.cached_index(root, version("lm_eval"), lambda _: built)
    (stored,) = tmp_path.iterdir()
    assert pickle.loads(stored.read_bytes()) == built
    task_index._MEMORY.clear()

    from lm_eval.tasks import TaskManager

    assert getattr(_index.TaskIndex.build, "_blockgen_cached", False)  # the .pth hook wrapped lm-eval's build
    manager = TaskManager()
    assert set(built) < set(manager.all_tasks) and "gsm8k_code" in manager.all_tasks
    assert {p.name for p in tmp_path.iterdir()} == {stored.name}  # read, not built again
