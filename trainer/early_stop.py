"""Early stopping on the evaluation loss (train.early_stop_patience, train.early_stop_min_delta).

As Lightning's EarlyStopping(monitor="val_loss", mode="min"): an evaluation improves when its loss
is lower than the best so far by more than min_delta; after `patience` evaluations in a row without
one, the run stops (a final checkpoint, one line, an `early_stop` row, exit 0).

Its state (the best loss, its step, the evaluations since it, the step the run stopped at) is a
small checkpoint part in meta.json (`early_stop`), so a resumed run stops at the same step as one
never interrupted, and a restart of a run that stopped early has nothing to do (the launcher reads
the newest checkpoint's record: trainer/layout.py) and is not requeued (trainer/requeue.py). A
restart with train.early_stop_patience=0, or a patience larger than the evaluations counted since
the best, trains on; raising train.steps alone does not.

Standard library only: the launcher asks `stops_again` before it imports torch.
"""

PART = "early_stop"  # the checkpoint part's name, a key of meta.json


class EarlyStop:
    """The early-stopping state of a run, a checkpoint part (state_dict / load_state_dict)."""

    def __init__(self, patience, min_delta):
        self.patience, self.min_delta = patience or 0, min_delta
        self.best = None  # the lowest eval loss so far (float), None before the first evaluation
        self.best_step = None  # the step of that evaluation
        self.since = 0  # evaluations since the best one that did not improve on it
        self.stopped = None  # the step the run stopped early at, else None

    def state_dict(self):
        return {"best": self.best, "best_step": self.best_step, "since": self.since, "stopped": self.stopped}

    def load_state_dict(self, state):
        """Restore a saved state (from meta.json, untrusted: a value not of its kind raises ValueError
        naming it); a stop that this run's patience no longer makes (0, or
        larger than the evaluations counted) is undone: the run trains on."""
        why = state_problem(state)
        if why:
            raise ValueError(f"meta.json's {PART}: {why}")
        self.best, self.best_step = state["best"], state["best_step"]
        self.since, self.stopped = state["since"], state["stopped"]
        if not stops_again(state, self.patience):
            self.stopped = None

    def problem(self, state):
        """Why a saved `state` cannot be restored, or None (the checkpoint's load asks first)."""
        return state_problem(state)

    def update(self, step, loss):
        """Count the evaluation at `step` with `loss`; the line to say if the run stops here, else None.
        Every rank gets the same loss (evaluate's all-reduce), so every rank decides alike."""
        if not self.patience:
            return None
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.best_step, self.since = loss, step, 0
            return None
        self.since += 1
        if self.since < self.patience:
            return None
        self.stopped = step
        by = f" by more than train.early_stop_min_delta={self.min_delta:g}" if self.min_delta else ""
        return (
            f"early stop at step {step}: eval loss {loss:.4f} has not improved on {self.best:.4f} (step "
            f"{self.best_step}){by} for {self.since} evaluations (train.early_stop_patience={self.patience})"
        )


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def state_problem(state):
    """Why `state` is not an early_stop part as state_dict writes it, or None."""
    if not isinstance(state, dict) or set(state) != {"best", "best_step", "since", "stopped"}:
        return "not the keys best, best_step, since, stopped"
    best = state["best"]
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float)) or best != best):
        return f"best is {best!r}, not a loss"[:120]
    for key in ("best_step", "stopped"):
        if state[key] is not None and not _count(state[key]):
            return f"{key} is {state[key]!r}, not a step"[:120]
    if not _count(state["since"]):
        return "since is {!r}, not a count".format(state["since"])[:120]
    return None


def stops_again(record, patience):
    """Whether a run whose newest checkpoint holds `record` (its early_stop part) stopped early and
    stays stopped under train.early_stop_patience=`patience`: the stop is kept unless early stopping
    is now off or its patience exceeds the evaluations counted since the best."""
    if state_problem(record) or record["stopped"] is None or not patience:
        return False
    return record["since"] >= patience


def nothing_to_do(step, patience):
    """The line of a restart of a run that stopped early at `step`."""
    return (
        f"nothing to do: the run stopped early at step {step} (train.early_stop_patience={patience}); to train "
        f"on, restart with train.early_stop_patience=0 or a larger patience"
    )
