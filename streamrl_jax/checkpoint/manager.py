"""Checkpointer: one orbax `CheckpointManager`, one step directory per save, exact resume.

Everything a resumed run needs is written *together* into `<directory>/<step>/`
(see `docs/checkpoint.md` for the layout and the exact-resume protocol):

* `state/`    the TrainState (params, opt_state, step, rng) as sharded arrays;
* `extra_<name>/` optional named array trees, one item each (critic state,
  reference params, the generation weights still needed by in-flight batches);
* `ranker/`   optional ranker state, stored on the host (it is small);
* `metadata/` the caller's JSON dict (policy version, prompt-iterator state,
  prompt bookkeeping, config snapshot);
* `manifest/` this module's own JSON: model fingerprint, shape/dtype signature
  of every saved array, PRNG-key implementations, saved items.

Saves are asynchronous: `save` returns after orbax's blocking phase and the
write continues on orbax's thread; the caller may donate the saved state to
the next step at once (the checkpoint keeps the values at save time).
Restores go straight into the target shardings given by the caller, so a
checkpoint written on one mesh restores onto any other mesh shape or device
count. With `processes` (a multi-controller run: the training processes of a
`jax.distributed` program) orbax works over that active set alone: the first
of them is the primary host, each process writes its own shards, and the
barriers span only them (`active_set.py`). The manifest is read and checked
before any array is touched: a checkpoint of another model, or a damaged one,
is a `ValueError` naming the mismatch or the directory, never an error from
deep inside orbax or XLA.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from streamrl_jax.checkpoint import active_set
from streamrl_jax.checkpoint.trees import (
    FINGERPRINT_DEFAULTS,
    abstract_key_data,
    abstract_tree,
    check_json,
    check_signature,
    decode_keys,
    encode_keys,
    signature,
)
from streamrl_jax.errors import UserError

FORMAT_VERSION = 1
_STATE, _EXTRA, _RANKER, _METADATA, _MANIFEST = "state", "extra", "ranker", "metadata", "manifest"
# The checkpointers of this process, and the lock that starts one save at a time
# (`Checkpointer.save`).
_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_SAVING = threading.Lock()


def _check_fingerprint(
    where: str, saved: Mapping[str, Any] | None, mine: Mapping[str, Any] | None
) -> None:
    """Raises ValueError naming every architecture field that differs (both values)."""
    if saved is None or mine is None:
        return
    saved = {**{k: v for k, v in FINGERPRINT_DEFAULTS.items() if k in mine}, **saved}
    if dict(saved) == dict(mine):
        return
    diff = [
        f"{k}: checkpoint {saved.get(k)} vs this run {mine.get(k)}"
        for k in sorted(set(saved) | set(mine))
        if saved.get(k) != mine.get(k)
    ]
    raise UserError(f"checkpoint {where} is from another model: " + ", ".join(diff))


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns.

    Attributes:
      step: the restored step.
      state: the train state in the requested shardings (typed PRNG keys rewrapped).
      extra: the requested extra array trees (empty dict when none were requested).
      ranker: the ranker state (host numpy arrays unless a target was given) or None.
      metadata: the caller's metadata dict as saved.
    """

    step: int
    state: Any
    extra: dict[str, Any]
    ranker: Any
    metadata: dict[str, Any]


class Checkpointer:
    """Keep-last-K, asynchronous checkpoints of one run in `directory` (one orbax manager).

    Typical use in a training loop::

        ckpt = Checkpointer(workdir + "/checkpoints", keep=3, save_every=50,
                            fingerprint=model_fingerprint(model_cfg))
        if (step := ckpt.latest_step()) is not None:
            r = ckpt.restore(step, abstract_state=jax.eval_shape(trainer.init_state),
                             state_shardings=trainer.state_shardings)
        ...
        ckpt.save(int(step), state, metadata={...})  # returns at once
        ...
        ckpt.close()  # waits (bounded) for the last write

    Args:
      directory: root directory; created if missing.
      keep: number of most recent checkpoints kept (older ones are deleted).
      save_every: `save` writes only steps divisible by this (unless `force`).
      async_save: write on orbax's background thread (False: `save` blocks).
      fingerprint: model identity (`model_fingerprint(cfg)`) stored with every
        save and compared on every restore; None skips that check (the
        shape/dtype signature is always checked).
      timeout_s: bound on every wait for the background writer.
      processes: the `jax.distributed` processes that save and restore together (a
        multi-controller run's training processes; every one of them makes the same
        calls); None: this process alone, or all of them.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        save_every: int = 1,
        async_save: bool = True,
        fingerprint: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
        processes: tuple[int, ...] | None = None,
    ):
        if keep < 1:
            raise ValueError(f"checkpoint keep={keep}: must be >= 1")
        if save_every < 1:
            raise ValueError(f"checkpoint save_every={save_every}: must be >= 1")
        self.directory = epath.Path(directory).absolute()
        self.save_every = save_every
        self.fingerprint = dict(fingerprint) if fingerprint is not None else None
        self.timeout_s = timeout_s
        self._pending: int | None = None  # step of the last save, until waited for
        self._host_sharding: Any = None  # active set: where host arrays are placed
        self.processes = tuple(processes) if processes and jax.process_count() > 1 else None
        options: dict[str, Any] = {"create": True}
        registry = None
        if self.processes is not None:
            if jax.process_index() not in self.processes:
                raise ValueError(
                    f"checkpoint: process {jax.process_index()} is not one of the saving "
                    f"processes {list(self.processes)}"
                )
            # orbax refuses create=True with an active set: each process makes the
            # directory itself (exist_ok), before the manager's first barrier.
            self.directory.mkdir(parents=True, exist_ok=True)
            mp, registry = active_set.options(self.processes)
            options = {"create": False, "multiprocessing_options": mp}
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, **options
            ),
            handler_registry=registry,
        )
        _LIVE.add(self)

    # ------------------------------------------------------------------ queries
    def step_directory(self, step: int) -> epath.Path:
        """Where step `step` is (or would be) stored."""
        return self.directory / str(step)

    def all_steps(self) -> list[int]:
        """Completely written steps, ascending (partial writes are never listed)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest completely written step, or None."""
        return self._mgr.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` (without `force`) writes."""
        return step % self.save_every == 0 and step not in self._mgr.all_steps()

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: Any,
        *,
        extra_arrays: Mapping[str, Any] | None = None,
        ranker: Any | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts writing one checkpoint; returns once the arrays are copied to host.

        The device buffers may be donated or overwritten as soon as this
        returns. A previous save still being written is waited for first (at
        most `timeout_s`).

        Args:
          step: the checkpoint's step (the number of optimizer steps taken).
          state: the TrainState (or any pytree of arrays; typed keys allowed).
          extra_arrays: named array trees saved alongside, e.g. `{"critic": ...,
            "ref_params": ..., "gen_weights": {"3": params}}` (string keys).
          ranker: ranker state (any pytree of arrays, copied to host) or None.
          metadata: JSON-serialisable dict returned unchanged by `restore`.
          force: write even if `step` is not a multiple of `save_every`.

        Returns:
          True if a save was started; False when skipped (not due, or `step`
          already saved).

        Raises:
          ValueError: metadata that is not JSON-serialisable.
          TimeoutError / RuntimeError: the previous save hung or failed.
        """
        if step in self._mgr.all_steps():
            logging.info("checkpoint: step %d already saved in %s", step, self.directory)
            return False
        if not force and step % self.save_every:
            return False
        metadata = dict(metadata or {})
        check_json(metadata)
        self.wait()
        state_data, state_keys = encode_keys(state)
        items: dict[str, Any] = {_STATE: ocp.args.StandardSave(state_data)}
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "step": step,
            "fingerprint": self.fingerprint,
            "signature": {_STATE: signature(state_data)},
            "prng_keys": {_STATE: state_keys},
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "time": time.time(),
        }
        for name, tree in (extra_arrays or {}).items():
            if not name.isidentifier():
                raise ValueError(f"checkpoint extra_arrays name {name!r} must be an identifier")
            # One orbax item per name, so a restore can ask for any subset.
            data, keys = encode_keys(tree)
            items[_EXTRA + "_" + name] = ocp.args.StandardSave(data)
            manifest["signature"][_EXTRA + "_" + name] = signature(data)
            manifest["prng_keys"][_EXTRA + "_" + name] = keys
        if ranker is not None:
            # Host copy: the ranker is small, and host arrays restore on any device set.
            ranker_data, ranker_keys = encode_keys(ranker)
            ranker_data = self._host(jax.device_get(ranker_data), state_data)
            items[_RANKER] = ocp.args.StandardSave(ranker_data)
            manifest["prng_keys"][_RANKER] = ranker_keys
        manifest["items"] = sorted(items) + [_METADATA, _MANIFEST]
        items[_METADATA] = ocp.args.JsonSave(metadata)
        items[_MANIFEST] = ocp.args.JsonSave(manifest)
        # orbax keeps process-wide state for a save under way (two managers saving at
        # once in one process collide on their temporary directories: "File exists"),
        # so with several in a process (several learners) a save starts once every
        # other one's has finished.
        with _SAVING:
            self._others_finished()
            started = self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
        if started:
            self._pending = step
        return started

    def _others_finished(self) -> None:
        """Waits (bounded) until no other live checkpointer of this process is saving."""
        deadline = time.monotonic() + self.timeout_s
        for other in list(_LIVE):
            if other is not self:
                other._until_saved(
                    deadline,
                    lambda o=other: (
                        f"checkpoint writer: {self.directory} waited "
                        f"{self.timeout_s:.0f} s for the save under way in {o.directory}"
                    ),
                )

    def _until_saved(self, deadline: float, stalled: Callable[[], str]) -> None:
        """Polls until no save of this manager is under way, instead of orbax's unbounded
        `wait_until_finished`, so a stuck filesystem becomes an error naming the
        component, not a hang. TimeoutError(`stalled()`) past `deadline`."""
        while self._mgr.is_saving_in_progress():
            if time.monotonic() > deadline:
                raise TimeoutError(stalled())
            time.sleep(0.01)

    def _host(self, tree: Any, state: Any) -> Any:
        """Host arrays as they can be saved: as they are, or in an active-set save
        (orbax writes host numpy from process 0 only) replicated on the state's mesh."""
        if self.processes is None:
            return tree
        if self._host_sharding is None:
            mesh = jax.tree.leaves(state)[0].sharding.mesh
            self._host_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, self._host_sharding), tree)

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until the background write (if any) is on disk.

        Raises:
          TimeoutError: naming the checkpoint writer and step, after `timeout_s`.
          RuntimeError: the background write failed (the original error chained).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._until_saved(
            time.monotonic() + timeout,
            lambda: (
                f"checkpoint writer: save of step {self._pending} to {self.directory} "
                f"still running after {timeout:.0f} s"
            ),
        )
        try:
            self._mgr.wait_until_finished()  # returns at once; surfaces writer errors
        except Exception as e:
            raise RuntimeError(
                f"checkpoint writer: save of step {self._pending} to {self.directory} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        self._pending = None

    def close(self) -> None:
        """Waits (bounded) for the last save, then releases orbax's resources."""
        try:
            self.wait()
        finally:
            _LIVE.discard(self)
            self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def _resolve_step(self, step: int | None) -> int:
        steps = self._mgr.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.directory} (have {sorted(steps)})"
            )
        return step

    def _read_json(self, step: int, item: str) -> dict[str, Any]:
        try:
            return self._mgr.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            )[item]
        except Exception as e:
            raise UserError(
                f"checkpoint {self.step_directory(step)} is corrupt or truncated: cannot read "
                f"its {item}: {type(e).__name__}: {e}"
            ) from e

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The caller's metadata of `step` (default latest) without touching any array.

        Use it to build `abstract_extra` (e.g. which generation-weight versions
        were saved) before `restore`.
        """
        return self._read_json(self._resolve_step(step), _METADATA)

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """This module's manifest of `step` (fingerprint, signatures, items)."""
        return self._read_json(self._resolve_step(step), _MANIFEST)

    def restore(
        self,
        step: int | None = None,
        *,
        abstract_state: Any,
        state_shardings: Any | None = None,
        abstract_extra: Mapping[str, Any] | None = None,
        abstract_ranker: Any | None = None,
    ) -> Restored:
        """Restores `step` (default latest) directly into the given shardings.

        Args:
          step: the step, or None for the latest.
          abstract_state: the target structure, e.g. `jax.eval_shape(trainer.init_state)`.
          state_shardings: matching tree of target shardings (e.g.
            `trainer.state_shardings`); None keeps `abstract_state`'s own.
            Any mesh shape or device count: orbax re-shards on load.
          abstract_extra: names (any subset of those saved) mapped to abstract
            trees *with* shardings (`abstract_tree`); None restores no extras.
            Each named tree is restored whole.
          abstract_ranker: target of the ranker state, e.g. the live
            `Ranker.state()`; None gives orbax's nested-dict form (optax
            namedtuples become dicts).

        Raises:
          FileNotFoundError: no checkpoint (of that step) in the directory.
          ValueError: another model (fingerprint or shapes, both named), a
            requested item that was not saved, or a corrupt/truncated
            checkpoint (naming its directory).
        """
        step = self._resolve_step(step)
        where = str(self.step_directory(step))
        manifest = self._read_json(step, _MANIFEST)
        _check_fingerprint(where, manifest.get("fingerprint"), self.fingerprint)
        target_state = abstract_key_data(abstract_tree(abstract_state, state_shardings))
        check_signature(
            "train state", where, manifest["signature"][_STATE], signature(target_state)
        )
        args: dict[str, Any] = {
            _STATE: ocp.args.StandardRestore(target_state),
            _METADATA: ocp.args.JsonRestore(),
        }
        for name, tree in (abstract_extra or {}).items():
            item = _EXTRA + "_" + name
            if item not in manifest["items"]:
                saved = [i[len(_EXTRA) + 1 :] for i in manifest["items"] if i.startswith(_EXTRA)]
                raise UserError(f"checkpoint {where} has no extra arrays {name!r} (it has {saved})")
            target = abstract_key_data(tree)
            check_signature(
                f"extra arrays {name!r}", where, manifest["signature"][item], signature(target)
            )
            args[item] = ocp.args.StandardRestore(target)
        if _RANKER in manifest["items"]:
            args[_RANKER] = ocp.args.StandardRestore(abstract_ranker)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:
            raise UserError(
                f"checkpoint {where} is corrupt or truncated: {type(e).__name__}: {e}"
            ) from e
        keys = manifest["prng_keys"]
        return Restored(
            step=step,
            state=decode_keys(out[_STATE], keys[_STATE]),
            extra={
                name: decode_keys(out[_EXTRA + "_" + name], keys[_EXTRA + "_" + name])
                for name in abstract_extra or {}
            },
            ranker=decode_keys(out[_RANKER], keys[_RANKER]) if _RANKER in args else None,
            metadata=out[_METADATA],
        )


def _open_step(path: str | os.PathLike, fingerprint: Mapping[str, Any] | None):
    """The `Checkpointer` of the checkpoint at `path` (a root: its latest step; or a step
    directory), that step, its directory and its manifest, the fingerprint checked."""
    path = epath.Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if (path / _MANIFEST).exists():  # a step directory: open its root at that step
        root, step = path.parent, path.name
        if not step.isdigit():
            raise UserError(f"checkpoint {path}: step directory name is not a step")
        step = int(step)
    else:
        root, step = path, None
    ckpt = Checkpointer(root, fingerprint=fingerprint)
    try:
        step = ckpt._resolve_step(step)
        where = str(ckpt.step_directory(step))
        manifest = ckpt._read_json(step, _MANIFEST)
        _check_fingerprint(where, manifest.get("fingerprint"), fingerprint)
    except BaseException:
        ckpt._mgr.close()
        raise
    return ckpt, step, where, manifest


def saved_params(
    path: str | os.PathLike, *, fingerprint: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, str]]:
    """The step directory `path` resolves to and its saved params' signature
    (`{keypath: "float32[256,64]"}`, key paths as in `trees.signature` of the params),
    read from the manifest without touching an array.

    Raises:
      FileNotFoundError: `path` does not exist or holds no checkpoint.
      ValueError: another model (`fingerprint`), or a corrupt checkpoint.
    """
    ckpt, _, where, manifest = _open_step(path, fingerprint)
    ckpt._mgr.close()
    state = manifest["signature"][_STATE]
    return where, {k[len(".params") :]: v for k, v in state.items() if k.startswith(".params[")}


def restore_params_only(
    path: str | os.PathLike,
    abstract_params: Any,
    shardings: Any | None = None,
    *,
    fingerprint: Mapping[str, Any] | None = None,
) -> Any:
    """The params of a checkpoint (`--config.init_from=PATH`); a run's policy, LoRA-aware,
    is `checkpoint.policy.policy_params`.

    Args:
      path: a checkpoint root (its latest step is used) or one step directory.
      abstract_params: target params structure (`trainer.state_shardings.params`
        shapes, e.g. `jax.eval_shape(trainer.init_state).params`).
      shardings: matching tree of target shardings; None keeps the abstract's own.
      fingerprint: this run's `model_fingerprint`, checked when given.

    Raises:
      FileNotFoundError: `path` does not exist or holds no checkpoint.
      ValueError: another model, or a corrupt checkpoint (naming the path).
    """
    ckpt, step, where, manifest = _open_step(path, fingerprint)
    try:
        target = {"params": abstract_tree(abstract_params, shardings)}
        # The saved state is a TrainState: its params' key paths start with ".params".
        want = {".params" + k: v for k, v in signature(target["params"]).items()}
        check_signature("params", where, manifest["signature"][_STATE], want)
        try:
            out = ckpt._mgr.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.PyTreeRestore(
                            target,
                            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                            partial_restore=True,  # only the params of the saved state
                        )
                    }
                ),
            )
        except Exception as e:
            raise UserError(f"checkpoint {where} is corrupt or truncated: {e}") from e
        return out[_STATE]["params"]
    finally:
        ckpt._mgr.close()
