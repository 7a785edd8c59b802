"""What watches the evaluation loss: early stopping (train.early_stop_patience,
train.early_stop_min_delta) and the best checkpoint.

Early stopping, as Lightning's EarlyStopping(monitor="val_loss", mode="min", check_finite=True): an
evaluation improves when its loss is lower than the best so far by more than min_delta; after
`patience` evaluations in a row without one, the run stops (a final checkpoint, one line, an
`early_stop` row, exit 0). A NaN or infinite eval loss stops it at once, the same way.

Its state (the best loss, its step, the evaluations since it, the step the run stopped at and why)
is a small checkpoint part in meta.json (`early_stop`), so a resumed run stops at the same step as
one never interrupted, and a restart of a run that stopped early has nothing to do (the launcher
reads the newest checkpoint's record: trainer/rundir/layout.py) and is not requeued (trainer/launchers/requeue.py).
A restart with train.early_stop_patience=0 trains on, as does one with a patience larger than the
evaluations counted since the best (after a stop by patience); raising train.steps alone does not.

The best checkpoint, as Lightning's ModelCheckpoint(monitor="val_loss", save_top_k=1): the
checkpoint of the evaluation with the lowest eval loss so far (strictly lower; a NaN never is). Its
step and loss are a checkpoint part too (`best_eval`), so the newest checkpoint names the best one
(covered by its manifest, and read only from a checkpoint of this run: trainer/checkpoint/manager.py);
retention never deletes the checkpoint it names. The training loop saves a checkpoint at an
evaluation that improves on the best when that step is not a checkpoint step already.

Standard library only: the launcher asks `stops_again` before it imports torch, trainer.metrics
reads the best checkpoint without torch.
"""

import math
import os

from trainer.rundir import layout

PART = "early_stop"  # the checkpoint part's name, a key of meta.json
KEYS = ("best", "best_step", "since", "stopped")  # its keys; `reason` too since NaN stops (older ones lack it)
PATIENCE, NOT_FINITE = "patience", "not_finite"  # why a run stopped early (`reason`)


class EarlyStop:
    """The early-stopping state of a run, a checkpoint part (state_dict / load_state_dict)."""

    def __init__(self, patience, min_delta):
        self.patience, self.min_delta = patience or 0, min_delta
        self.best = None  # the lowest eval loss so far (float), None before the first evaluation
        self.best_step = None  # the step of that evaluation
        self.since = 0  # evaluations since the best one that did not improve on it
        self.stopped = None  # the step the run stopped early at, else None
        self.reason = None  # why it stopped there: PATIENCE or NOT_FINITE; None while it trains

    def state_dict(self):
        return {
            "best": self.best,
            "best_step": self.best_step,
            "since": self.since,
            "stopped": self.stopped,
            "reason": self.reason,
        }

    def load_state_dict(self, state):
        """Restore a saved state that problem() accepted (the checkpoint's load asks it first: meta.json
        is untrusted; checked once, there); a stop that this run's patience no longer makes (0, or
        larger than the evaluations counted) is undone: the run trains on."""
        self.best, self.best_step = state["best"], state["best_step"]
        self.since, self.stopped = state["since"], state["stopped"]
        self.reason = reason_of(state)
        if not _stays_stopped(state, self.patience):
            self.stopped = self.reason = None

    def problem(self, state):
        """Why a saved `state` (meta.json's, untrusted) cannot be restored, or None: the one check of
        it, asked by the checkpoint's load before load_state_dict."""
        return state_problem(state)

    def update(self, step, loss):
        """Count the evaluation at `step` with `loss`; the line to say if the run stops here, else None.
        Every rank gets the same loss (evaluate's all-reduce), so every rank decides alike."""
        if not self.patience:
            return None
        if not math.isfinite(loss):  # Lightning's check_finite: no later evaluation can mend it
            self.stopped, self.reason = step, NOT_FINITE
            best = f" (the best was {self.best:.4f} at step {self.best_step})" if self.best is not None else ""
            return (
                f"early stop at step {step}: eval loss {loss} is not finite; the run stops at once{best}; "
                f"lower optim.lr or look at the evaluation data, then restart with train.early_stop_patience=0 "
                f"to train on"
            )
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.best_step, self.since = loss, step, 0
            return None
        self.since += 1
        if self.since < self.patience:
            return None
        self.stopped, self.reason = step, PATIENCE
        if loss < self.best:  # lower, but by no more than min_delta
            what = f"improved on the best, {self.best:.4f} at step {self.best_step}, by {self.best - loss:.4g} only"
        else:
            what = f"is not below the best, {self.best:.4f} at step {self.best_step}"
        by = f" by more than train.early_stop_min_delta={self.min_delta:g}" if self.min_delta else ""
        return (
            f"early stop at step {step}: eval loss {loss:.4f} {what}; {self.since} evaluations in a row without an "
            f"improvement{by} (train.early_stop_patience={self.patience})"
        )


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _loss(value):
    """Whether `value` is a loss as a state records it: a finite number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def state_problem(state):
    """Why `state` is not an early_stop part as state_dict writes it (or as it did before `reason`), or None."""
    if not isinstance(state, dict) or set(state) - {"reason"} != set(KEYS):
        return "not the keys best, best_step, since, stopped, reason"
    best = state["best"]
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float)) or best != best):
        return f"best is {best!r}, not a loss"[:120]
    for key in ("best_step", "stopped"):
        if state[key] is not None and not _count(state[key]):
            return f"{key} is {state[key]!r}, not a step"[:120]
    if not _count(state["since"]):
        return "since is {!r}, not a count".format(state["since"])[:120]
    reason = state.get("reason")
    if "reason" in state and (
        reason not in (None, PATIENCE, NOT_FINITE) or (reason is None) != (state["stopped"] is None)
    ):
        return f"reason is {reason!r}, not why it stopped ({PATIENCE} or {NOT_FINITE}; null while it trains)"[:120]
    return None


def reason_of(record):
    """Why the run of the early_stop part `record` stopped (a record saved before `reason`: patience)."""
    if record["stopped"] is None:
        return None
    return record.get("reason") or PATIENCE


def stops_again(record, patience):
    """Whether a run whose newest checkpoint holds `record` (its early_stop part) stopped early and
    stays stopped under train.early_stop_patience=`patience`: the stop is kept unless early stopping
    is now off or, for a stop by patience, its patience exceeds the evaluations counted since the best."""
    return state_problem(record) is None and _stays_stopped(record, patience)


def _stays_stopped(record, patience):
    """stops_again for a `record` already checked (state_problem)."""
    if record["stopped"] is None or not patience:
        return False
    return reason_of(record) == NOT_FINITE or record["since"] >= patience


def nothing_to_do(step, patience, reason=PATIENCE):
    """The line of a restart of a run that stopped early at `step` (for `reason`: reason_of its record)."""
    if reason == NOT_FINITE:  # no patience mends it
        return (
            f"nothing to do: the run stopped early at step {step}, whose eval loss was not finite "
            f"(train.early_stop_patience={patience}); to train on, restart with train.early_stop_patience=0"
        )
    return (
        f"nothing to do: the run stopped early at step {step} (train.early_stop_patience={patience}); to train "
        f"on, restart with train.early_stop_patience=0 or a larger patience"
    )


# -- the best checkpoint --------------------------------------------------------------------------

BEST = "best_eval"  # the checkpoint part's name, a key of meta.json


class Best:
    """The evaluation with the lowest eval loss so far, a checkpoint part: its `step` and `loss`."""

    def __init__(self):
        self.step = None  # the step of that evaluation, None before the first finite one
        self.loss = None

    def state_dict(self):
        return {"step": self.step, "loss": self.loss}

    def load_state_dict(self, state):
        why = best_problem(state)
        if why:
            raise ValueError(f"meta.json's {BEST}: {why}")
        self.step, self.loss = state["step"], state["loss"]

    def problem(self, state):
        """Why a saved `state` cannot be restored, or None (the checkpoint's load asks first)."""
        return best_problem(state)

    def update(self, step, loss):
        """Whether the evaluation at `step` with `loss` is the best so far (then it is recorded)."""
        if not math.isfinite(loss) or (self.loss is not None and loss >= self.loss):
            return False
        self.step, self.loss = step, loss
        return True

    @staticmethod
    def pinned(state):
        """The steps retention keeps for this part's `state` in the checkpoint just committed: the best's."""
        return [] if best_problem(state) or state["step"] is None else [state["step"]]


def best_problem(state):
    """Why `state` is not a best_eval part as Best.state_dict writes it, or None."""
    if not isinstance(state, dict) or set(state) != {"step", "loss"}:
        return "not the keys step, loss"
    if (state["step"] is None) != (state["loss"] is None):
        return "step and loss are not both set or both null"
    if state["step"] is not None and not _count(state["step"]):
        return f"step is {state['step']!r}, not a step"[:120]
    if state["loss"] is not None and not _loss(state["loss"]):
        return f"loss is {state['loss']!r}, not a loss"[:120]
    return None


def best_step(run_dir, newest):
    """The step of the run's best checkpoint, as the checkpoint `newest` (a (step, folder) of the
    run's complete checkpoints, its newest) records it; ValueError with the line to say (what is
    missing, what to do) where it names none: --best of trainer.export, evaluate, generate."""
    step, path = newest
    meta = layout.read_meta(path)
    record = meta.get(BEST)
    if record is None:
        return _no_best(run_dir, step, meta, "its checkpoints were saved before the best one was recorded")
    why = best_problem(record)
    if why:
        raise ValueError(f"--best: {path}/meta.json's {BEST} is unusable ({why}); give --step N")
    if record["step"] is None:
        return _no_best(run_dir, step, meta, "no evaluation has given a loss yet")
    return record["step"]


def _no_best(run_dir, step, meta, why):
    config = meta.get("config")
    section = config.get("eval") if isinstance(config, dict) else None
    interval = section.get("interval") if isinstance(section, dict) else None
    if interval == 0:
        why = "the run has no evaluation (eval.interval=0) to choose one by"
    raise ValueError(
        f"--best: {run_dir} has no best checkpoint: {why} (newest checkpoint: step {step}); give --step N, or "
        f"neither for the newest"
    )


def best_checkpoint(run_dir):
    """(step, eval loss, folder) of the run's best checkpoint as its newest committed checkpoint
    records it, or None where there is none (no evaluation yet, or its folder is gone): what
    trainer.metrics' summary names, read with the standard library (trainer/rundir/layout.py's checks)."""
    newest = layout.latest_committed_step(run_dir)
    if newest is None:
        return None
    try:
        record = layout.read_meta(layout.step_path(run_dir, newest)).get(BEST)
    except (OSError, ValueError):
        return None
    if best_problem(record) or record["step"] is None:
        return None
    path = layout.step_path(run_dir, record["step"])
    if os.path.islink(path) or layout.files_problem(path) is not None:
        return None
    meta, run = layout.read_meta(path), layout.read_run_id(run_dir)  # the run's own, as latest_committed_step asks
    if meta.get("step") != record["step"] or (run and meta.get("run_id") not in (None, run)):
        return None
    return record["step"], record["loss"], path
