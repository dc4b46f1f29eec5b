"""sdk/pool.py: several exports loaded on demand within one memory budget, the least recently used
idle one unloaded to make room, pinned and busy ones kept, idle ones unloaded after keep_alive."""

import threading
import time

import pytest
from conftest import linked_copy

from edgeinfer import BusyError, Engine, ModelNotFoundError, SettingsError
from edgeinfer.sdk.pool import ModelPool, _planned_bytes

PROMPT = [1, 5, 9, 14]


@pytest.fixture(scope="module")
def models(tiny_llama, chain_llama, tmp_path_factory):
    """Three exports: the tiny llama, the chain llama (other weights, other tokens) and a copy of the first."""
    copy = tmp_path_factory.mktemp("pool") / "copy"
    linked_copy(tiny_llama[1], copy)
    return {"a": tiny_llama[1], "b": chain_llama[0], "c": copy}


def _two_fit(models) -> int:
    """A budget that holds the two largest plans but not all three."""
    sizes = sorted(_planned_bytes(f, {"max_batch": 2}) for f in models.values())
    return sizes[-1] + sizes[-2] + sizes[0] // 2


def _greedy(scheduler, prompt=PROMPT, tokens=6) -> list[int]:
    return scheduler.submit(prompt, max_new_tokens=tokens, ignore_eos=True).result().token_ids


def _alone(folder, prompt=PROMPT, tokens=6) -> list[int]:
    return Engine.load(folder, provider="cpu").generate(prompt, max_new_tokens=tokens, ignore_eos=True).token_ids


def test_models_load_on_first_use_and_the_least_recently_used_idle_one_makes_room(models):
    with ModelPool(models, memory_limit=_two_fit(models), keep_alive=None, max_batch=2, provider="cpu") as pool:
        assert pool.names == ["a", "b", "c"] and not any(pool.is_loaded(n) for n in pool.names)
        with pool.use("a") as a:
            assert _greedy(a) == _alone(models["a"])
        with pool.use("b") as b:
            assert _greedy(b) == _alone(models["b"])
        with pool.use("a") as a:  # a is now the more recently used
            _greedy(a)
        assert [s["loaded"] for s in pool.status()] == [True, True, False]
        with pool.use("c") as c:  # no room for three: b, the least recently used, goes
            assert _greedy(c) == _alone(models["c"])
        assert [s["loaded"] for s in pool.status()] == [True, False, True]
        stats = pool.stats()
        assert (stats["models_loaded"], stats["model_loads_total"], stats["model_unloads_total"]) == (2, 3, 1)
        assert stats["model_memory_bytes"] == pool.held <= pool.memory_limit and stats["model_load_seconds_total"] > 0


def test_a_pinned_model_stays_and_a_busy_one_is_never_unloaded(models):
    with ModelPool(models, memory_limit=_two_fit(models), keep_alive=None, pin=("a",), max_batch=2, provider="cpu") as pool:
        pool.load("a")
        pool.load("b")
        pool.load("c")  # a is the least recently used but pinned: b goes
        assert [s["loaded"] for s in pool.status()] == [True, False, True]
        with pool.use("c"):  # c busy (a caller inside `use`), a pinned: nothing may go for b
            with pytest.raises(BusyError, match=r"model 'b' needs .* held by models that are serving requests or pinned \(a, c\)"):
                pool.load("b")
        assert pool.is_loaded("a") and pool.is_loaded("c") and not pool.is_loaded("b")
        assert pool.stats()["model_memory_bytes"] == pool.held  # the refused load reserved nothing
        pool.load("b")  # c is idle again
        assert [s["loaded"] for s in pool.status()] == [True, True, False]


def test_a_running_request_is_not_cut_by_another_models_load(models):
    with ModelPool(models, memory_limit=_two_fit(models), keep_alive=None, max_batch=2, provider="cpu") as pool:
        pool.load("b")
        with pool.use("a") as a:
            running = a.submit(PROMPT, max_new_tokens=200, ignore_eos=True)
        pool.load("c")  # a is running (older use than b, but busy): b goes
        assert running.result().token_ids == _alone(models["a"], tokens=200)
        assert [s["loaded"] for s in pool.status()] == [True, False, True]


def test_a_model_that_cannot_fit_alone_is_refused_with_the_figures(models):
    need = _planned_bytes(models["a"], {"max_batch": 2})
    with ModelPool(models, memory_limit=need - 1, keep_alive=None, max_batch=2, provider="cpu") as pool:
        with pytest.raises(SettingsError, match=r"model 'a' needs .* but the memory limit is .*: raise the limit"):
            pool.load("a")
        assert not pool.is_loaded("a") and pool.held == 0


def test_idle_models_are_unloaded_after_keep_alive_and_never_with_none(models):
    with ModelPool({"a": models["a"]}, keep_alive=0.2, provider="cpu") as pool:
        pool.load("a")
        deadline = time.monotonic() + 10
        while pool.is_loaded("a") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pool.is_loaded("a") and pool.stats()["model_unloads_total"] == 1
    with ModelPool({"a": models["a"]}, keep_alive=None, provider="cpu") as pool:
        pool.load("a")
        time.sleep(0.3)
        assert pool.is_loaded("a")


def test_concurrent_requests_to_different_models_answer_as_alone(models):
    expected = {name: _alone(folder, tokens=12) for name, folder in models.items()}
    got = {}
    with ModelPool(models, keep_alive=None, max_batch=2, provider="cpu") as pool:

        def ask(name):
            with pool.use(name) as scheduler:
                request = scheduler.submit(PROMPT, max_new_tokens=12, ignore_eos=True)
            got[name] = request.result().token_ids

        threads = [threading.Thread(target=ask, args=(name,)) for name in [*models, *models]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert got == expected and pool.stats()["model_loads_total"] == 3  # each loaded once


def test_unknown_names_and_bad_settings_are_refused(models):
    with ModelPool(models, keep_alive=None, provider="cpu") as pool:
        with pytest.raises(ModelNotFoundError, match=r"no model named 'x' here: the models are a, b, c"):
            with pool.use("x"):
                pass
    with pytest.raises(ModelNotFoundError, match=r"cannot pin x: the models are a, b, c"):
        ModelPool(models, pin=("x",))
    with pytest.raises(SettingsError, match="keep_alive must be seconds"):
        ModelPool(models, keep_alive=-1)
    with pytest.raises(SettingsError, match="at least one model"):
        ModelPool({})


def test_a_load_that_cannot_fit_unloads_nothing(models, tmp_path):
    """Busy models hold so much that even unloading every idle one would not make room: the load is
    refused before anything is unloaded."""
    big, small = sorted(["a", "b"], key=lambda n: -_planned_bytes(models[n], {"max_batch": 2}))
    linked_copy(models[big], tmp_path / "big2")
    chosen = {"big": models[big], "small": models[small], "big2": tmp_path / "big2"}
    sizes = {n: _planned_bytes(f, {"max_batch": 2}) for n, f in chosen.items()}
    assert sizes["big"] > sizes["small"]
    with ModelPool(chosen, memory_limit=sizes["big"] + sizes["small"], keep_alive=None, max_batch=2, provider="cpu") as pool:
        pool.load("small")
        with pool.use("big"):  # busy; small idle, but big + big2 > the limit even without small
            with pytest.raises(
                BusyError, match=r"model 'big2' needs .* held by models that are serving requests or pinned \(big\)"
            ) as busy:
                pool.load("big2")
            assert busy.value.code == "memory_busy"  # not a full queue
            assert pool.is_loaded("small") and pool.stats()["model_unloads_total"] == 0


def test_an_unloaded_model_keeps_no_tokenizer_and_the_plan_counts_it(models):
    """The server's view of a pooled model (serve/models.py) holds a load's tokenizer only while a
    request holds that load."""
    import gc
    import weakref

    from edgeinfer.sdk.manifest import load_manifest
    from edgeinfer.sdk.memory import MemoryPlan, tokenizer_bytes
    from edgeinfer.serve.models import PooledModels

    manifest = load_manifest(models["a"])
    assert tokenizer_bytes(manifest) == 9 * manifest.files["tokenizer.json"]["size"] > 0
    plan = MemoryPlan.of(manifest, manifest.max_context, 2)
    assert _planned_bytes(models["a"], {"max_batch": 2}) == plan.total + tokenizer_bytes(manifest)
    with ModelPool(models, keep_alive=None, max_batch=2, provider="cpu") as pool:
        served = PooledModels(pool)
        loaded = served.prepared("a")
        assert loaded.tokenizer.encode("Hi", False) and pool.is_loaded("a")
        tokenizer = weakref.ref(loaded.tokenizer)
        del loaded
        assert pool.unload("a")
        gc.collect()
        assert tokenizer() is None
