"""Checkpointer: exact round trip, async save, keep-last-K, re-sharding on load, bad checkpoints.

Every equality here is exact (`assert_array_equal`): saving and restoring
copies bytes, and one optimizer step from a restored state runs the same
compiled program on the same values as from the original state.
"""

import os
import signal
import threading

import grain
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import AlgorithmSection, OptimizerSection
from streamrl_jax.model import config as model_config
from streamrl_jax.trainer import TrainerConfig, make_batch, make_policy_trainer

CFG = TrainerConfig(
    algorithm=AlgorithmSection(dual_clip=0.0),
    optimizer=OptimizerSection(learning_rate=1e-3, max_grad_norm=0.0),
    seq_buckets=(16,),
    batch_buckets=(8,),
)
MODEL = model_config.tiny()


def _trainer(n_devices: int, model=MODEL):
    devices = jax.devices()[:n_devices]
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), devices).train
    return make_policy_trainer(model, CFG, mesh)


def _host(tree):
    """Host copies (device buffers may be donated afterwards); keys as raw data."""
    return jax.tree.map(
        lambda x: np.array(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
            copy=True,
        ),
        tree,
    )


def _assert_equal(a, b):
    la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def _batch(trainer):
    rng = np.random.default_rng(0)
    n = 8
    responses = [rng.integers(0, 256, rng.integers(1, 8)) for _ in range(n)]
    host = make_batch(
        [rng.integers(0, 256, rng.integers(1, 6)) for _ in range(n)],
        responses,
        behaviour_logp=[np.full(len(r), -5.0, np.float32) for r in responses],
        advantages=rng.normal(size=n).astype(np.float32),
        seq_buckets=CFG.seq_buckets,
        batch_buckets=CFG.batch_buckets,
    )
    return trainer.place_batch(host)


def _train_step(trainer, state, batch):
    acc, _ = trainer.accumulate(state, trainer.init_accumulator(), batch, trainer.scalar(1.0))
    state, _, _ = trainer.apply(state, acc)
    return state


@pytest.fixture(scope="module")
def fsdp8():
    return _trainer(8)


@pytest.fixture(scope="module")
def trained(fsdp8):
    """A state one optimizer step in (non-trivial Adam moments and count), new rng."""
    state = _train_step(fsdp8, fsdp8.init_state(0), _batch(fsdp8))
    return state.replace(rng=jax.random.fold_in(state.rng, 7))


def _ckpt(tmp_path, **kw):
    kw.setdefault("fingerprint", ckpt_lib.model_fingerprint(MODEL))
    return ckpt_lib.Checkpointer(tmp_path / "ckpt", **kw)


def _abstract(trainer):
    return jax.eval_shape(trainer.init_state)


def test_round_trip_is_exact_with_extras_ranker_and_metadata(tmp_path, fsdp8, trained):
    # The grain iterator state, as PromptPipeline.get_state() wraps it.
    it = grain.MapDataset.range(10).shuffle(seed=3).repeat().to_iter_dataset().__iter__()
    [next(it) for _ in range(13)]
    metadata = {
        "policy_version": 1,
        "prompts": {"iterator": it.get_state(), "consumed": 13, "dropped_overlong": 0},
        "in_flight": {"batches": [1], "prompt_ids": ["p3", "p7"]},
        "config": {"pipeline": {"mode": "stream_async", "staleness": 1}},
    }
    # Shaped like `scheduling.ranker.Ranker.state()`: host params, optax state, step count.
    ranker_params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    ranker = {
        "params": ranker_params,
        "opt_state": jax.device_get(optax.adam(1e-3).init(ranker_params)),
        "steps": np.asarray(3, np.int64),
    }
    extra = {"ref_params": trained.params, "gen_weights": {"0": trained.params}}
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.save(1, trained, extra_arrays=extra, ranker=ranker, metadata=metadata)
        ckpt.wait()
        assert ckpt.latest_step() == 1
        assert ckpt.read_metadata() == metadata
        sh = fsdp8.state_shardings
        r = ckpt.restore(
            abstract_state=_abstract(fsdp8),
            state_shardings=sh,
            abstract_extra={"gen_weights": {"0": ckpt_lib.abstract_tree(trained.params)}},
            abstract_ranker=ranker,
        )
    assert r.step == 1
    _assert_equal(r.state, trained)
    assert jax.dtypes.issubdtype(r.state.rng.dtype, jax.dtypes.prng_key)
    assert int(r.state.step) == 1
    assert jax.tree.leaves(r.state.params)[0].sharding == jax.tree.leaves(sh.params)[0]
    # Only the requested subset of the extras comes back.
    assert set(r.extra) == {"gen_weights"}
    _assert_equal(r.extra["gen_weights"]["0"], trained.params)
    # With the live ranker's state as target, the optax namedtuples come back as such.
    assert jax.tree.structure(r.ranker) == jax.tree.structure(ranker)
    for got, want in zip(jax.tree.leaves(r.ranker), jax.tree.leaves(ranker), strict=True):
        assert isinstance(got, np.ndarray) and got.dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(got, want)
    assert r.metadata == metadata
    # The grain iterator resumes where it stopped.
    resumed = grain.MapDataset.range(10).shuffle(seed=3).repeat().to_iter_dataset().__iter__()
    resumed.set_state(r.metadata["prompts"]["iterator"])
    assert [next(resumed) for _ in range(9)] == [next(it) for _ in range(9)]


def test_async_save_returns_before_write_and_buffers_may_be_donated(tmp_path, fsdp8, trained):
    # A fresh copy never read on the host: a host read (np.asarray) caches a
    # zero-copy view on CPU, which would make the donation below silently copy.
    state = jax.tree.map(lambda x: x.copy(), trained)
    expected = _host(trained)
    with _ckpt(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(1, state)
        # Donates `state` while the write may still be running: the checkpoint must
        # hold the values at save time, not whatever the buffers hold later. (On
        # CPU the writer reads a zero-copy host view of the device buffers, so JAX
        # skips this donation and allocates fresh outputs; either way, no corruption.)
        after = _train_step(fsdp8, state, _batch(fsdp8))
        ckpt.wait(timeout_s=120)
        r = ckpt.restore(1, abstract_state=_abstract(fsdp8), state_shardings=fsdp8.state_shardings)
    _assert_equal(r.state, expected)
    assert int(after.step) == 2


def test_keep_last_k_and_save_every(tmp_path, fsdp8, trained):
    with _ckpt(tmp_path, keep=2, save_every=2) as ckpt:
        written = [s for s in range(1, 7) if ckpt.save(s, trained)]
        assert written == [2, 4, 6]
        assert ckpt.save(7, trained, force=True)
        assert not ckpt.save(7, trained, force=True)  # already saved: skipped, no error
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["6", "7"]


@pytest.mark.parametrize("n_devices", [2, 1])
def test_restore_onto_another_mesh(tmp_path, fsdp8, trained, n_devices):
    extra = {"ref_params": trained.params}
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, trained, extra_arrays=extra)
        ckpt.wait()
        small = _trainer(n_devices)
        sh = small.state_shardings
        r = ckpt.restore(
            abstract_state=_abstract(small),
            state_shardings=sh,
            abstract_extra={
                "ref_params": ckpt_lib.abstract_tree(_abstract(small).params, sh.params)
            },
        )
    _assert_equal(r.state, trained)
    _assert_equal(r.extra["ref_params"], trained.params)
    for leaf, want in zip(jax.tree.leaves(r.state.params), jax.tree.leaves(sh.params), strict=True):
        assert isinstance(leaf.sharding, NamedSharding)
        assert leaf.sharding == want
        assert len(leaf.sharding.device_set) == n_devices
    # Params-only restore (init_from) onto the small mesh, from the root and a step dir.
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "1"):
        params = ckpt_lib.restore_params_only(path, _abstract(small).params, sh.params)
        _assert_equal(params, trained.params)
        assert jax.tree.structure(params) == jax.tree.structure(sh.params)


def test_step_after_restore_equals_step_after_original(tmp_path, fsdp8, trained):
    batch = _batch(fsdp8)
    original = jax.tree.map(lambda x: x.copy(), trained)
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, original)
        ckpt.wait()
        restored = ckpt.restore(
            abstract_state=_abstract(fsdp8), state_shardings=fsdp8.state_shardings
        ).state
    a = _host(_train_step(fsdp8, original, batch))
    b = _host(_train_step(fsdp8, restored, batch))
    _assert_equal(a, b)
    assert np.max(np.abs(a.params["embed"].value - _host(trained.params)["embed"].value)) > 0


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path, fsdp8, trained):
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, trained)
    other_model = model_config.tiny(hidden_size=32)
    other = _trainer(8, other_model)
    # With fingerprints: names the differing architecture field.
    fp = ckpt_lib.model_fingerprint(other_model)
    with (
        ckpt_lib.Checkpointer(tmp_path / "ckpt", fingerprint=fp) as ckpt,
        pytest.raises(ValueError, match="another model: hidden_size: checkpoint 64 vs this run 32"),
    ):
        ckpt.restore(abstract_state=_abstract(other), state_shardings=other.state_shardings)
    # Without: the shape signature names both shapes.
    with (
        ckpt_lib.Checkpointer(tmp_path / "ckpt") as ckpt,
        pytest.raises(
            ValueError,
            match=r"\['embed'\].*checkpoint float32\[256,64\] vs this run float32\[256,32\]",
        ),
    ):
        ckpt.restore(abstract_state=_abstract(other), state_shardings=other.state_shardings)
    with pytest.raises(ValueError, match="another model"):
        ckpt_lib.restore_params_only(
            tmp_path / "ckpt", _abstract(other).params, other.state_shardings.params, fingerprint=fp
        )


def _saved(tmp_path, trained):
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, trained)
    return tmp_path / "ckpt" / "1"


def _restore(tmp_path, trainer):
    with _ckpt(tmp_path) as ckpt:
        return ckpt.restore(
            1, abstract_state=_abstract(trainer), state_shardings=trainer.state_shardings
        )


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_garbage_array_bytes_are_a_clear_error(tmp_path, fsdp8, trained):
    step_dir = _saved(tmp_path, trained)
    data = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:
        p.write_bytes(b"\x00garbage" * 8)
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt or truncated"):
        _restore(tmp_path, fsdp8)


# Orbax's internal event loop may report an ignored error after a failed read.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("missing", ["manifest", "state/manifest.ocdbt", "state/_METADATA"])
def test_missing_files_are_a_clear_error(tmp_path, fsdp8, trained, missing):
    step_dir = _saved(tmp_path, trained)
    target = step_dir / missing
    if target.is_dir():
        for p in sorted(target.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        target.rmdir()
    else:
        target.unlink()
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt or truncated"):
        _restore(tmp_path, fsdp8)


def test_partial_write_is_never_listed(tmp_path, fsdp8, trained):
    # A run killed mid-write leaves orbax's temporary directory, never `<step>/`.
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, trained)
        ckpt.save(2, trained)
    root = tmp_path / "ckpt"
    (root / "2").rename(root / "2.orbax-checkpoint-tmp-1234")
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        assert ckpt.restore(abstract_state=_abstract(fsdp8)).step == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path, fsdp8):
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no checkpoint to restore in .*ckpt"):
            ckpt.restore(abstract_state=_abstract(fsdp8))
    with pytest.raises(FileNotFoundError, match="checkpoint .*nowhere does not exist"):
        ckpt_lib.restore_params_only(tmp_path / "nowhere", _abstract(fsdp8).params)


def test_unserialisable_metadata_fails_at_save(tmp_path, trained):
    with _ckpt(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"metadata\['bad'\] is not JSON-serialisable"):
            ckpt.save(1, trained, metadata={"ok": 1, "bad": object()})
        assert ckpt.latest_step() is None


def test_shutdown_handler_sets_flag_then_second_signal_passes_through():
    got, outer = [], []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: outer.append(signum))
    try:
        request = ckpt_lib.install_shutdown_handler(got.append, signals=(signal.SIGUSR1,))
        assert not request.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.event.wait(10)
        assert got == [signal.SIGUSR1] and request.signum == signal.SIGUSR1 and not outer
        # The second signal restores the previous handler and re-delivers to it.
        os.kill(os.getpid(), signal.SIGUSR1)
        assert got == [signal.SIGUSR1] and outer == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not before or before is None
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_checkpoint_from_before_the_newer_fingerprint_fields_restores(tmp_path, fsdp8, trained):
    # Written before q/k norms and experts were fingerprinted: its model was dense.
    fp = ckpt_lib.model_fingerprint(MODEL)
    old = {k: v for k, v in fp.items() if k not in ckpt_lib.trees.FINGERPRINT_DEFAULTS}
    with _ckpt(tmp_path, fingerprint=old) as ckpt:
        ckpt.save(1, trained)
    with _ckpt(tmp_path, fingerprint=fp) as ckpt:
        assert (
            ckpt.restore(
                abstract_state=_abstract(fsdp8), state_shardings=fsdp8.state_shardings
            ).step
            == 1
        )
    moe = ckpt_lib.model_fingerprint(MODEL.replace(num_experts=4, experts_per_token=2,
                                                   moe_intermediate_size=32))  # fmt: skip
    with (
        _ckpt(tmp_path, fingerprint=moe) as ckpt,
        pytest.raises(ValueError, match="num_experts: checkpoint 0 vs this run 4"),
    ):
        ckpt.restore(abstract_state=_abstract(fsdp8), state_shardings=fsdp8.state_shardings)


def test_two_checkpointers_saving_at_once_in_one_process_both_land(tmp_path):
    # Several learners in one process each have a checkpointer; orbax keeps process-wide
    # state for a save under way, and two async saves at once collided on their temporary
    # directories ("File exists") before saves were started one at a time.
    errors: list[BaseException] = []

    def saves(name: str) -> None:
        try:
            with ckpt_lib.Checkpointer(str(tmp_path / name), keep=2, save_every=1) as c:
                for step in range(1, 9):
                    tree = {
                        "w": np.full((64, 64), step, np.float32),
                        "b": np.arange(10, dtype=np.float32),
                    }
                    c.save(step, tree, extra_arrays={"gen": {"3": tree}})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=saves, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for name in ("a", "b"):
        with ckpt_lib.Checkpointer(str(tmp_path / name), keep=2) as c:
            assert c.all_steps() == [7, 8]
            want = {"w": np.full((64, 64), 8, np.float32), "b": np.arange(10, dtype=np.float32)}
            got = c.restore(8, abstract_state=ckpt_lib.abstract_tree(jax.device_put(want)))
            np.testing.assert_array_equal(np.asarray(got.state["w"]), want["w"])
