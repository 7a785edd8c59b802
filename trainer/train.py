"""The training loop: build everything, resume, then accumulate, clip, step, log, evaluate, save."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer import data, hf, models, optim, torch_compat
from trainer import dist as distributed
from trainer import early_stop as early_stopping
from trainer.checkpoint import manager, remote
from trainer.config import Config, dump, to_dict
from trainer.observe.metrics import Reporter, Speed, peak_flops, start_times, timed
from trainer.observe.trackers import Trackers, sinks_on
from trainer.parallel import plan as parallel
from trainer.parallel import pp as pipeline
from trainer.preflight.interval import GPU_MTBF_HOURS, AutoInterval, save_seconds
from trainer.preflight.startup import Ready, nothing_to_do
from trainer.resilience import hangs, health, signals
from trainer.rundir import files, layout, objects
from trainer.rundir.lease import Lease, LeaseError, LeaseLost

log = logging.getLogger("trainer")


def batch_plan(cfg: Config, dp_size: int) -> tuple[int, int]:
    """(samples per forward/backward, accumulation steps) per rank, the global batch divided over the
    `dp_size` data-parallel ranks (the plan's); the config check guarantees they divide. Under pipeline
    parallelism one forward/backward is parallel.pp_microbatches micro-batches of train.micro_batch_size
    (default: the rank's samples over them)."""
    per_rank = cfg.train.global_batch_size // dp_size
    p = cfg.parallel
    micro = pipeline.micro_batch(p, per_rank, cfg.train.micro_batch_size) * pipeline.microbatches(p)
    return micro, per_rank // micro


def build_model(cfg: Config, env: distributed.Env, plan: parallel.Plan | None = None) -> torch.nn.Module:
    """The model, wrapped by the parallel plan (`plan`, else the one of `cfg` and `env`), with the
    same initial weights on any number of processes. A family with its own init_weights (the
    transformer) is built on the meta device and initialised shard by shard."""
    torch.manual_seed(cfg.train.seed)
    plan = plan or parallel.Plan.of(cfg.parallel, env)
    family = models.spec(cfg.model)
    if family.init_weights:
        with torch.device("meta"):
            model = family.build(cfg.model)
        model = plan.apply(model, family)
        family.init_weights(parallel.unwrap(model), cfg.train.seed)
        return model
    return plan.apply(family.build(cfg.model), family)


@torch.no_grad()
def evaluate(
    model, cfg: Config, env: distributed.Env, dataset, compute_dtype, plan: parallel.Plan | None = None
) -> dict:
    """Mean loss (and accuracy for classifiers) over fixed evaluation batches, over all ranks; each
    data-parallel rank takes its own part of them (the rank and size of `plan`, else of the plan of
    `cfg` and `env`)."""
    model.eval()
    plan = plan or parallel.Plan.of(cfg.parallel, env)
    micro, _ = batch_plan(cfg, plan.dp_size)
    start = 2**61 if len(dataset) >= 2**62 else 0  # generated data: a range training never reaches
    batches = data.loader(
        dataset, cfg.data, cfg.train.seed, start, micro * plan.dp_size, micro, plan.dp_rank, plan.dp_size
    )
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
    family = models.spec(cfg.model)
    for _ in range(cfg.eval.batches):
        x, y, _ = next(batches)
        x, y = x.to(env.device), y.to(env.device)
        with plan.autocast(compute_dtype), plan.loss_parallel():  # under tp the logits stay vocabulary-sharded
            logits = plan.forward(model, x, y)  # None on a pipeline stage before the last
            if logits is None:
                continue
            totals[0] += _local(family.loss(logits, y)).double() * y.numel()
        if family.kind == "classifier":
            totals[1] += (logits.argmax(-1) == y).sum()
        totals[2] += y.numel()
    dist.all_reduce(totals)
    model.train()
    result = {"eval_loss": (totals[0] / totals[2]).item()}
    if family.kind == "classifier":
        result["eval_accuracy"] = (totals[1] / totals[2]).item()
    return result


def evaluate_sources(model, cfg, env, eval_set, compute_dtype, plan: parallel.Plan | None = None) -> dict:
    """evaluate's numbers for `eval_set`; for a mixture's per-source evaluation files
    (data.EvalSources: data.sources[i].eval_path) each source's as eval_loss/<source> (and
    eval_accuracy/<source>), and eval_loss their mean weighted by the sources' weights."""
    if not isinstance(eval_set, data.EvalSources):
        return evaluate(model, cfg, env, eval_set, compute_dtype, plan)
    results = {name: evaluate(model, cfg, env, dataset, compute_dtype, plan) for name, dataset in eval_set.items()}
    weights = eval_set.weights
    mean = sum(weights[name] * r["eval_loss"] for name, r in results.items()) / sum(weights.values())
    return {"eval_loss": mean, **{f"{k}/{name}": v for name, r in results.items() for k, v in r.items()}}


def train(ready: Ready) -> None:
    """Train the config the preflight checked and resolved (trainer/preflight/startup.py) as this rank."""
    cfg = ready.cfg
    times = {"imported": time.time()}  # the start's moments, for the resume row (metrics.start_times)
    env = distributed.init(timeout_s=cfg.parallel.timeout_s)
    control = distributed.cpu_group(timeout_s=cfg.parallel.timeout_s)  # stop flag, rank-0 decisions
    io_group = distributed.cpu_group(timeout_s=cfg.checkpoint.timeout_s)  # DCP, also from its own thread
    times["process_group"] = time.time()
    if cfg.health.enabled:  # before the first step: the fabric between the nodes (trainer/resilience/health.py)
        health.check_allreduce(cfg.health, env, hangs.node())
    run_dir = cfg.run_dir
    datasets = _datasets(cfg, env, control)  # bad data stops the run here, before the run dir is touched
    staging = (
        remote.Staging(run_dir, env.rank, env.local_rank, env.local_world_size) if objects.is_remote(run_dir) else None
    )
    if staging is None:  # an s3:// run dir's staging folders are each node's own
        distributed.check_nodes(run_dir, control)
    lease = _take_lease(run_dir, env, control, staging)  # before anything in the run dir changes
    if staging is not None:  # from here on the run works in this node's staging folder
        cfg = _staged(cfg, staging, control)
        run_dir = cfg.run_dir
    store = torch_compat.default_store()
    store.set(f"trainer/where/{env.rank}", f"{hangs.node()} {os.getpid()}")  # named in hang files and straggler lines
    watchdog = hangs.Watchdog(run_dir, env.rank, cfg.parallel.timeout_s, store)  # armed by the loop's first step
    plan, chosen = _plan(cfg, env, control)
    try:
        _train(Run.build(cfg, env, control, io_group, times, datasets, lease, watchdog, plan, chosen, staging))
        if staging is not None and env.is_main:  # the end's status and metrics
            staging.upload_run_files()
    except RuntimeError as e:  # torch.distributed.DistBackendError is one
        watchdog.stop()
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise StuckRank(_stuck_ranks(env, cfg.parallel.timeout_s, e, run_dir, watchdog.step)) from None
    finally:
        watchdog.stop()
        if lease:
            lease.release()


@dataclass(frozen=True)
class Run:
    """One start of training, from set-up to tear-down: what the loop's phases share, passed as one
    object (torchtitan's Trainer holds the same). Built at once by Run.build, every part named here
    in the order it is built; nothing is added later."""

    cfg: Config  # resolved by the preflight (trainer/preflight/startup.py)
    env: distributed.Env
    control: object  # gloo group: the stop flag and rank-0 decisions
    io_group: object  # gloo group of the checkpoint's collectives (DCP), also from its own thread
    times: dict  # the start's moments, for the resume row (metrics.start_times)
    train_set: object  # the training data: a mixture's origin goes into each checkpoint (data.position)
    eval_set: object  # the evaluation data, None without evaluation (eval.interval=0)
    lease: Lease | None  # rank 0's lease of the run dir (None on the other ranks)
    staging: remote.Staging | None  # an s3:// run dir's store and this node's staging folder, else None
    watchdog: hangs.Watchdog
    plan: parallel.Plan  # how the model is spread: the data-parallel rank and size, wrapping, autocast
    grad_sync_line: str | None  # why parallel.grad_sync=auto chose as it did (None: nothing to choose)
    model: torch.nn.Module  # wrapped by the plan, with its initial weights (a checkpoint's are loaded later)
    loss_fn: object  # the family's loss, compiled with the model where it is
    optimizer: torch.optim.Optimizer
    scheduler: object  # the learning rate's schedule
    scaler: object  # fp16's loss scaler, else None
    compute_dtype: object  # autocast's dtype, else None
    early: early_stopping.EarlyStop  # early stopping's state, a checkpoint part
    best: early_stopping.Best  # the best eval loss's step, a checkpoint part
    ckpt: manager.Checkpointer  # saves and loads every part above
    reporter: Reporter  # lines and metrics rows (rank 0's), the trackers

    @classmethod
    def build(
        cls,
        cfg: Config,
        env,
        control,
        io_group,
        times: dict,
        datasets: tuple,
        lease,
        watchdog,
        plan,
        grad_sync_line,
        staging=None,
    ) -> Run:
        """The run of this start: the process's parts (made by train(), which also ends them) and,
        built here in this order, the model and what trains it, the checkpoint parts, the
        checkpointer that saves them, the reporter. Nothing in the run dir changes yet."""
        model = build_model(cfg, env, plan)
        loss_fn = _loss_fn(cfg)
        optimizer = optim.build(model.parameters(), cfg.optim, env.device)
        scheduler = optim.scheduler(optimizer, cfg.optim, cfg.train.steps)
        scaler = plan.scaler()
        compute_dtype = plan.autocast_dtype(model)
        early = early_stopping.EarlyStop(cfg.train.early_stop_patience, cfg.train.early_stop_min_delta)
        best = early_stopping.Best()
        parts = {"scheduler": scheduler, "scaler": scaler, early_stopping.PART: early, early_stopping.BEST: best}
        ckpt = _checkpointer(cfg, env, io_group, lease, model, optimizer, parts, plan, staging)
        reporter = Reporter(cfg.run_dir, cfg.log, cfg.train.steps, env.is_main)
        train_set, eval_set = datasets
        return cls(
            cfg=cfg,
            env=env,
            control=control,
            io_group=io_group,
            times=times,
            train_set=train_set,
            eval_set=eval_set,
            lease=lease,
            staging=staging,
            watchdog=watchdog,
            plan=plan,
            grad_sync_line=grad_sync_line,
            model=model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            compute_dtype=compute_dtype,
            early=early,
            best=best,
            ckpt=ckpt,
            reporter=reporter,
        )


def _plan(cfg: Config, env: distributed.Env, group) -> tuple[parallel.Plan, str | None]:
    """The run's parallel plan, parallel.grad_sync=auto decided by the memory estimate against this
    rank's GPU (on the CPU: this machine's memory over its ranks), the same on every rank (one
    needing every_micro_batch makes it so for all); and the line that says why, or None."""
    from trainer.preflight import memory

    forward, _ = batch_plan(cfg, parallel.Plan(cfg.parallel, env.world_size).dp_size)
    micro = forward // pipeline.microbatches(cfg.parallel)  # the estimate's: one micro-batch of a stage
    if env.device.type == "cuda":
        have = torch.cuda.get_device_properties(env.device).total_memory
    else:
        have = (memory.machine_bytes() or 0) // env.local_world_size
    chosen, line = memory.choose_grad_sync(
        cfg, env.world_size, micro, env.local_world_size, have, env.device.type == "cuda"
    )
    if line is not None and _agreed_max(group, float(chosen.parallel.grad_sync == "every_micro_batch"))[0]:
        return parallel.Plan.of(dataclasses.replace(cfg.parallel, grad_sync="every_micro_batch"), env), line
    return parallel.Plan.of(chosen.parallel, env), line


class StuckRank(Exception):
    """A collective timed out: some rank stopped answering. The message names the step and the rank."""


def _reached(env: distributed.Env, step: int, watchdog: hangs.Watchdog) -> None:
    """Tell the rendezvous store (torchrun's TCP store) that this rank is at `step`: one small write
    per step, read back when a collective times out (_stuck_ranks); and this rank's watchdog."""
    torch_compat.default_store().set(f"trainer/step/{env.rank}", str(step))
    watchdog.reached(step)


def _stuck_ranks(env: distributed.Env, timeout_s: int, error: Exception, run_dir: str, step: int) -> str:
    """The message for a timed-out collective: every rank that timed out says so in the store, and
    waits a little for the others to; the ranks that never do are the ones that stopped answering.
    This rank's stacks and the silent ranks go into the hang folder (trainer/resilience/hangs.py)."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    why = f"a collective timed out after {timeout_s} s (parallel.timeout_s): {first_line}"
    store = None
    try:
        store = torch_compat.default_store()
        store.set_timeout(timedelta(seconds=5))
        store.set(f"trainer/timed_out/{env.rank}", "1")
        # The ranks still running wait in the same collective, entered within a step's spread: they
        # time out within that spread of each other. A stopped rank never says so: the wait ends
        # TIMED_OUT_GRACE_S after the newest rank said it, and at most min(timeout_s, 10) s.
        now = time.monotonic()
        deadline, quiet_until, silent_before = now + min(timeout_s, 10), now + hangs.TIMED_OUT_GRACE_S, None
        while True:
            silent = [r for r in range(env.world_size) if not store.check([f"trainer/timed_out/{r}"])]
            now = time.monotonic()
            if silent_before is not None and len(silent) < silent_before:
                quiet_until = now + hangs.TIMED_OUT_GRACE_S
            silent_before = len(silent)
            if not silent or now > min(deadline, quiet_until):
                break
            time.sleep(0.2)
        step = store.get(f"trainer/step/{env.rank}").decode()
        who = ", ".join(f"rank {r} (last seen at step {store.get(f'trainer/step/{r}').decode()})" for r in silent)
        hangs.dump(
            run_dir,
            store,
            env.rank,
            int(step),
            why,
            {
                "silent": [
                    hangs.silent_line(
                        r, store.get(f"trainer/where/{r}").decode(), store.get(f"trainer/step/{r}").decode()
                    )
                    for r in silent
                ]
            },
            error,
        )
        return (
            f"at step {step}, rank {env.rank} waited {timeout_s} s (parallel.timeout_s) for {who or 'another rank'}, "
            f"which did not answer; the run stops so that it can be restarted (under Slurm it is requeued) "
            f"[{first_line}]"
        )
    except Exception:  # noqa: BLE001 - the store may be gone with the launcher: say what is known
        hangs.dump(run_dir, store, env.rank, step, why, error=error)
        return (
            f"rank {env.rank} waited {timeout_s} s (parallel.timeout_s) for a rank that did not answer; the run stops "
            f"so that it can be restarted [{first_line}]"
        )


def _take_lease(run_dir: str, env: distributed.Env, group, staging=None) -> Lease | None:
    """Rank 0 takes the run dir's lease (an s3:// run dir's: the lease object); every rank raises
    LeaseError if it cannot."""
    lease, refused = None, [None]
    if env.is_main:
        lease = objects.ObjectLease(staging.store) if staging is not None else Lease(run_dir)
    if lease:
        try:
            lease.acquire()
        except LeaseError as e:
            refused = [(LeaseError, str(e))]
        except (objects.StoreError, OSError) as e:  # the lease object's store failed: said by every rank
            refused = [(objects.StoreError, f"run_dir {run_dir}: taking its lease failed: {e}")]
    dist.broadcast_object_list(refused, src=0, group=group)
    if refused[0]:
        kind, line = refused[0]
        raise kind(line)
    return lease


def _staged(cfg: Config, staging: remote.Staging, group) -> Config:
    """An s3:// run dir (trainer/checkpoint/remote.py), once rank 0 holds its lease: each node's staging
    folder made afresh with the run's files, the bucket's newest committed checkpoint staged on every
    node (its small files; each node's shards when the load reads them); the config then names the
    staging folder, with blocking saves (an upload needs every rank at once). A failure of the store
    on any rank stops every rank with its line."""
    staging.prepare(group)
    staging.resume(group)
    checkpoint = dataclasses.replace(cfg.checkpoint, async_save=False)
    return dataclasses.replace(cfg, run_dir=staging.local, checkpoint=checkpoint)


def _datasets(cfg: Config, env: distributed.Env, group) -> tuple:
    """(training set, evaluation set or None), built by rank 0 first (it downloads what is missing:
    MNIST), then by the others. A DataError on any rank is raised on every rank with the first
    message, so that rank 0 says it in one line and no rank is left in a collective that fails."""
    sets = None
    for rank_0_turn in (True, False):
        error = None
        if env.is_main == rank_0_turn:
            try:
                train_set = data.build(cfg.data, cfg.model, cfg.train.seed, train=True)
                eval_set = data.build(cfg.data, cfg.model, cfg.train.seed, train=False) if cfg.eval.interval else None
                sets = train_set, eval_set
            except data.DataError as e:
                error = str(e)
        errors: list = [None] * env.world_size
        dist.all_gather_object(errors, error, group=group)
        first = next((e for e in errors if e), None)
        if first:
            raise data.DataError(first)
    return sets


def _train(run: Run) -> None:
    # set-up: the run's parts (Run.build), the newest checkpoint (or model.init_from), the run dir
    cfg, env, plan, lease, watchdog = run.cfg, run.env, run.plan, run.lease, run.watchdog
    model, loss_fn, optimizer, scheduler, scaler = run.model, run.loss_fn, run.optimizer, run.scheduler, run.scaler
    ckpt, reporter, compute_dtype = run.ckpt, run.reporter, run.compute_dtype
    train_set, eval_set = run.train_set, run.eval_set
    run_dir = cfg.run_dir
    micro, accum = batch_plan(cfg, plan.dp_size)
    B = cfg.train.global_batch_size
    step, samples, meta = _resume(cfg, env, ckpt, model, scheduler, reporter, run.times)
    change = data.resume(train_set, meta)  # a mixture: each source from its own position
    if change:
        reporter.message(change)
    if run.early.stopped is not None:  # stopped early, and this start's patience keeps it stopped: nothing written
        _nothing_to_do(cfg, env, reporter, nothing_to_do(cfg, step, run.early.state_dict()))
        return
    _accept_start(cfg, env, reporter, step, meta, run.times)
    if step >= cfg.train.steps:
        _nothing_to_do(cfg, env, reporter, nothing_to_do(cfg, step))
        return
    batches = data.loader(train_set, cfg.data, cfg.train.seed, samples, B, micro, plan.dp_rank, plan.dp_size)
    trace = _open_trace(run_dir, env.rank) if cfg.data.trace else None  # the sample trace file (data.trace)
    _begin_steps(run, model, step)
    # This rank's compute time since the last row: CPU seconds of this process in the step's own work
    # (data, forward, backward, clip, optimizer), so the waits for other ranks in the collectives FSDP
    # runs inside forward and backward do not count (a wall clock would give every rank the slowest
    # one's time). On GPUs this is the host's share (data, Python, kernel launches), not the kernels'.
    compute_s, window_steps = 0.0, 0
    # First step whose loss or gradient norm was not finite, or -1; on the device: read (a sync) only
    # when logging and before saving, so nothing non-finite is ever written or committed.
    first_bad = torch.full((), -1, device=env.device)
    while step < cfg.train.steps:
        _reached(env, step + 1, watchdog)
        compute_start = time.process_time()
        # accumulate: the mean loss over the global batch, micro-batch by micro-batch
        loss_sum = torch.zeros((), device=env.device)
        for i in range(accum):
            x, y, index = next(batches)
            if trace:
                trace.write(f"{step} {' '.join(map(str, index.tolist()))}\n")
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            # forward and backward, through the plan (pipeline parallelism replaces this one call); sum: the
            # gradient of the sum over the micro-batch's samples (tokens), as the tutorial's reduction="sum"
            grad_scale = y.numel() * accum if cfg.train.loss_reduction == "sum" else 1
            loss = plan.forward_backward(
                model,
                x,
                y,
                loss_fn,
                micro=i,
                accum=accum,
                compute_dtype=compute_dtype,
                scaler=scaler,
                grad_scale=grad_scale,
            )
            loss_sum += _local(loss)  # under tp a replicated DTensor: each rank holds the whole

        # clip
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = None
        if cfg.train.grad_clip is not None:
            grad_norm = plan.clip_grad_norm(model, cfg.train.grad_clip)  # over every pipeline stage

        # step (an async save in flight must have copied the weights first)
        ckpt.wait_staged()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if cfg.parallel.float8 != "none":  # tensorwise under FSDP: the next all-gathers' scales, all at once
            from trainer.parallel import float8

            float8.precompute_scales(model, cfg.parallel, plan.fsdp_ranks)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, samples = step + 1, samples + B
        reporter.epochs(step, data.epoch_starts(train_set, samples - B, samples))  # a source's pass begins: a row
        window_steps += 1
        bad = ~torch.isfinite(loss_sum)
        if grad_norm is not None and not scaler:  # with fp16 loss scaling, inf gradients are routine: skipped
            bad |= ~torch.isfinite(_local(grad_norm))
        first_bad = torch.where(bad & (first_bad < 0), step, first_bad)
        compute_s += time.process_time() - compute_start

        # log: one all-reduce (_agree) carries the loss, the stop, divergence and lease flags, the compute times
        stopping = None  # not agreed yet at this step
        if step % cfg.log.interval == 0 or step == cfg.train.steps:
            loss_total, diverged, stops, lost, cpu_s = _agree(env, loss_sum, first_bad, lease, compute_s / window_steps)
            if lost:
                _raise_lease_lost(lease, ckpt.shown(run_dir), step, ckpt)
            if diverged:
                _raise_diverged(first_bad, ckpt)
            stopping = stops > 0
            # the ranks of one tp group hold the same loss: the mean over all is the data-parallel mean;
            # of a pipeline's stages only the last holds it (plan.loss_ranks: the ranks that do)
            values = {"loss": loss_total / plan.loss_ranks, "lr": lr, **data.epochs(train_set, samples)}
            if grad_norm is not None:
                values["grad_norm"] = _full(grad_norm).item()
            if scaler:
                values["loss_scale"] = scaler.get_scale()
            reporter.training_row(step, values, cpu_s)
            compute_s, window_steps = 0.0, 0

        # evaluate (and early stopping's count: `early` is its line when the run stops here; `best`:
        # the best eval loss so far, whose checkpoint is saved now, as Lightning's ModelCheckpoint does)
        early, best = None, False
        if eval_set is not None and step % cfg.eval.interval == 0:
            parallel.average_batchnorm_stats(model)  # the same statistics on every rank
            watchdog.allow(cfg.parallel.timeout_s)  # the evaluation is not a step: its own allowance
            result = evaluate_sources(
                model, cfg, env, eval_set, compute_dtype, plan
            )  # eval_loss/<source> with data.sources
            reporter.message(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
            reporter.write(timed({"step": step, **result}))
            best = run.best.update(step, result["eval_loss"])
            early = _early_stop(run, step, result["eval_loss"])
            stopping = None  # a signal may have come during the evaluation: ask again

        # save
        if stopping is None:  # the stop flag and the lease, agreed in one tiny CPU all-reduce
            stops, lost = _agreed_max(run.control, float(signals.pending()), float(bool(lease and lease.lost)))
            if lost:
                _raise_lease_lost(lease, ckpt.shown(run_dir), step, ckpt)
            stopping = stops > 0
        _save(run, model, step, samples, first_bad, stopping or early is not None, best)
        if early:
            break
        if stopping:
            if not os.environ.get(signals.MARKS_ENV):  # else the launcher says it, with the signal's name
                reporter.message(
                    f"stopped by signal after step {step}; the checkpoint is saved, a restart resumes here"
                )
            break

    # tear-down
    _finish(run, step, trace)


def _early_stop(run: Run, step: int, eval_loss: float) -> str | None:
    """Count the evaluation at `step` for early stopping (trainer/early_stop.py); when the run stops
    here, say its line and write its `early_stop` row now, before the final save: a start that
    resumes from an earlier checkpoint moves the row aside with the step's others, so it stays once."""
    line = run.early.update(step, eval_loss)
    if line:
        run.reporter.message(line)
        state = run.early.state_dict()
        run.reporter.write(
            timed(
                {
                    "event": "early_stop",
                    "step": step,
                    "best_eval_loss": state["best"],
                    "best_step": state["best_step"],
                    "patience": run.early.patience,
                    "reason": state["reason"],
                }
            )
        )
    return line


def _save(run: Run, model, step: int, samples: int, first_bad: torch.Tensor, stopping: bool, best: bool) -> None:
    """The loop's one call to save, after every step (torchtitan's checkpointer.save(step,
    last_step=...)): the checkpointer says whether a save is due (a stop, the last step, the
    interval), and one is at an evaluation with the best eval loss so far (`best`); if it is,
    nothing non-finite is saved (Diverged instead, on every rank), BatchNorm's statistics become all
    ranks' (the checkpoint keeps one rank's copy), the watchdog allows the save its own time, and
    the checkpointer saves, blocking at a stop and at the end."""
    if not run.ckpt.due(step, stopping) and not best:
        return
    _stop_if_diverged(first_bad, run.ckpt, model)
    parallel.average_batchnorm_stats(model)
    run.watchdog.allow(run.cfg.checkpoint.timeout_s)
    run.ckpt.save_due(step, {"samples": samples, "config": to_dict(run.cfg), **data.position(run.train_set)}, stopping)


def _checkpointer(
    cfg: Config, env, io_group, lease, model, optimizer, parts: dict, plan: parallel.Plan, staging=None
) -> manager.Checkpointer:
    """The run's checkpoint manager of the model, the optimizer and the named `parts` beside them (a
    pipeline's stages each save their own, under the whole model's names)."""
    stages = plan.mesh["pp"].get_group() if plan.pp > 1 else None
    args, downloaded = cfg.checkpoint, {}
    if objects.is_remote(args.resume_from):  # a checked local copy on every node, loaded as a folder
        # not where the run dir has checkpoints of its own, which win (a restart of a run started from it)
        later = staging.later if staging is not None else (lambda path: frozenset())  # shards in the bucket
        own = [bool(manager.complete(cfg.run_dir, later=later)) if env.rank == 0 else None]
        dist.broadcast_object_list(own, src=0, group=io_group)
        if not own[0]:
            local = remote.checkpoint_copy(args.resume_from, io_group, env.rank, env.local_rank, env.local_world_size)
            downloaded[local] = args.resume_from  # the lines name it by its URL (Checkpointer.shown)
            args = dataclasses.replace(args, resume_from=local)
    ckpt = manager.Checkpointer(
        args,
        cfg.run_dir,
        env.rank,
        env.world_size,
        io_group,
        model,
        optimizer,
        parts=parts,
        stages=stages,
        staging=staging,
    )
    ckpt.aliases.update(downloaded)
    if lease:  # rank 0 reads the lease again right before it commits or deletes a checkpoint
        ckpt.still_owner = lease.check
    return ckpt


def _resume(
    cfg: Config, env: distributed.Env, ckpt: manager.Checkpointer, model, scheduler, reporter: Reporter, times: dict
) -> tuple:
    """(step, samples consumed, the checkpoint's meta or None): the newest checkpoint loaded, with a
    line for each change of the schedule; without one, a new run from model.init_from's weights (a
    folder in a bucket: first downloaded on each node, checked, into a private folder removed at
    exit). The load's start and end go into `times`."""
    step, samples = 0, 0
    times["load_start"] = time.time()
    meta = ckpt.load()
    times["loaded"] = time.time()
    if meta:
        step, samples = meta["step"], meta["samples"]
        saved_lr = meta.get("config", {}).get("optim", {}).get("lr", cfg.optim.lr)
        if saved_lr != cfg.optim.lr:
            reporter.message(
                f"optim.lr is {cfg.optim.lr:g}, the checkpoint's was {saved_lr:g}: the schedule goes on from "
                f"step {step} with the new peak"
            )
        change = optim.schedule_change(meta.get("config", {}), cfg.optim, cfg.train.steps, step)
        if change:
            reporter.message(change)
        optim.set_peak_lr(scheduler, cfg.optim, cfg.train.steps)
        change = data.stream_change(meta.get("config", {}), cfg.data, step)  # other files or weights
        if change:
            reporter.message(change)
        reporter.message(
            f"resumed from {meta['path']} at step {step} (saved by {meta['world_size']} processes, loaded in "
            f"{meta['load_time_s']:.2f}s)"
        )
        if cfg.model.init_from:
            reporter.message(
                f"model.init_from={cfg.model.init_from} is not used: this run dir has checkpoints of its own"
            )
    elif cfg.model.init_from:  # a new run from a Hugging Face folder: its weights, step 0
        started = time.perf_counter()
        try:
            folder = cfg.model.init_from
            if objects.is_remote(folder):
                folder = remote.hf_copy(folder, ckpt.group, env.rank, env.local_rank, env.local_world_size)
            hf.load_weights(parallel.unwrap(model), folder, cfg.model)
        except hf.HFError as e:
            raise manager.CheckpointError(f"model.init_from: {e}") from None
        reporter.message(f"initialised from {cfg.model.init_from} in {time.perf_counter() - started:.2f}s")
    return step, samples, meta


def _accept_start(
    cfg: Config, env: distributed.Env, reporter: Reporter, step: int, meta: dict | None, times: dict
) -> None:
    """The start is accepted: only now the run dir's config and status change, the metrics rows of an
    earlier start after `step` move aside (a resume row holds the start's moments, `times`), and the
    trackers (rank 0's) start."""
    if env.is_main:
        dump(cfg, os.path.join(cfg.run_dir, "config.yaml"))
        layout.write_status(cfg.run_dir, state="running", steps=cfg.train.steps, step=step)
    reporter.start(step, meta, start_times(**times))  # rows after `step` are an earlier start's: each step's row once
    if env.is_main and sinks_on(cfg.log):
        reporter.trackers = Trackers(cfg.run_dir, cfg.log, to_dict(cfg), meta["step"] if meta else None)
    warning = optim.schedule_warning(cfg.optim, cfg.train.steps)
    if warning:
        reporter.message(f"warning: {warning}")


def _nothing_to_do(cfg: Config, env: distributed.Env, reporter: Reporter, line: str) -> None:
    """A start with nothing to do (trainer/preflight/startup.py's `line`: at or past train.steps, or of
    a run that stopped early): say so, mark the run finished, close the trackers."""
    reporter.message(line)
    if env.is_main:
        layout.write_status(cfg.run_dir, state="finished")
    if reporter.trackers:
        reporter.trackers.close()


def _begin_steps(run: Run, model, step: int) -> None:
    """Before the first step: the line that says what trains, the checkpointer's save plan, and the
    reporter's speed (tokens/s and MFU for an LM) and straggler names."""
    cfg, env, plan, ckpt, reporter = run.cfg, run.env, run.plan, run.ckpt, run.reporter
    micro, accum = batch_plan(cfg, plan.dp_size)
    n_params = sum(p.numel() for p in model.parameters())  # sharded: numel() is the global size
    m = plan.pp_microbatches
    params = f"{n_params / 1e6:.2f}M params" + (f" on {plan.stages_line}" if plan.pp > 1 else "")  # rank 0's
    stages = f", pipeline schedule {cfg.parallel.pp_schedule}" if plan.pp > 1 else ""
    if plan.hybrid:  # HSDP: the 2-D data-parallel mesh (inside each stage under a pipeline)
        stages = f" (hybrid: {plan.dp_replicate} replicas of {plan.dp_shard}-rank shards){stages}"
    samples = f"{micro // m} samples x {m} pipeline micro-batches" if plan.pp > 1 else f"{micro} samples"
    reporter.message(
        f"training {cfg.model.name} ({params}) on {env.world_size} x {env.device.type}, "
        f"strategy {plan.strategy}{stages}, {samples} x {accum} micro-batches per rank, steps "
        f"{step}->{cfg.train.steps}"
    )
    if run.grad_sync_line:
        reporter.message(run.grad_sync_line)
    model.train()
    ckpt.plan(
        cfg.train.steps,
        step,
        _auto_interval(cfg, env, ckpt.shown(cfg.run_dir)) if cfg.checkpoint.interval == "auto" else None,
        reporter.message,
    )
    count_flops = models.spec(cfg.model).flops_per_token
    lm = count_flops is not None
    speed = Speed(
        cfg.train.global_batch_size,
        cfg.model.seq_len if lm else None,
        count_flops(parallel.unwrap(model)) if lm else None,
        peak_flops(env.device),
        env.world_size,
        env.device,
    )
    store = torch_compat.default_store()  # where each rank runs: set in train()
    reporter.begin(step, speed, node_of=lambda r: store.get(f"trainer/where/{r}").decode().split(" ")[0])


def _finish(run: Run, step: int, trace) -> None:
    """After the last step (or a stop): the watchdog, the last async save, the trackers and the trace
    (`trace`, else None) closed in this order; a lease lost at the last save raised; the status and
    the closing line."""
    cfg, env, control, lease, watchdog = run.cfg, run.env, run.control, run.lease, run.watchdog
    ckpt, reporter = run.ckpt, run.reporter
    run_dir = cfg.run_dir
    watchdog.stop()  # what follows (the last async save's end) is not a step
    ckpt.close()
    if reporter.trackers:
        reporter.trackers.close()
    if trace:
        trace.close()
    if _agreed_max(control, float(bool(lease and lease.lost)))[0]:  # lost at the last save: say so, not finished
        _raise_lease_lost(lease, ckpt.shown(run_dir), step, ckpt)
    if env.is_main:
        done = step >= cfg.train.steps or run.early.stopped is not None  # an early stop is an end too
        layout.write_status(run_dir, state="finished" if done else "stopped", step=step)
    if step == cfg.train.steps:
        shown = run.staging.url if run.staging else run_dir  # an s3:// run dir by its name, not its staging copy
        reporter.message(
            f"finished at step {step}: checkpoint {layout.step_path(shown, step)}, metrics {shown}/metrics.jsonl; "
            f"next: {next_commands(shown)}"
        )
    dist.barrier(group=control)


def next_commands(run_dir) -> str:
    """What to do with a finished run, with the interpreter that ran it (a bare `python` outside the
    venv has no torch): sys.executable, relative to the cwd when it is inside it."""
    python = sys.executable
    with contextlib.suppress(ValueError):  # another drive (Windows): keep it absolute
        relative = os.path.relpath(python)
        if not relative.startswith(os.pardir):
            python = relative
    return (
        f"{python} -m trainer.metrics {run_dir} (summary), {python} -m trainer.export {run_dir} --format hf "
        f"--out DIR, {python} -m trainer.generate {run_dir} --prompt TEXT, {python} -m trainer.evaluate {run_dir}"
    )


def _auto_interval(cfg: Config, env: distributed.Env, shown: str) -> AutoInterval:
    """checkpoint.interval=auto's state: the job's MTBF and the save cost until one is measured (this
    run dir's last blocking save, else the state's size at the assumed write speed: trainer/preflight/interval.py);
    `shown`: the run dir as its line names it (an s3:// run dir's URL)."""
    mtbf_hours = cfg.checkpoint.mtbf_hours or GPU_MTBF_HOURS / env.world_size
    nodes = max(1, env.world_size // env.local_world_size)
    save_s, how = save_seconds(cfg, nodes, cfg.run_dir, shown)
    return AutoInterval(mtbf_hours * 3600, save_s, how.split(":")[0])


def _agree(env: distributed.Env, loss_sum, first_bad, lease, compute_s: float) -> tuple:
    """At a logged step, in one all-reduce (each extra collective is a point where the faster rank
    waits): (the loss summed over the ranks, whether a rank diverged, whether a rank got a stop
    signal, whether rank 0 lost the run dir's lease, each rank's compute seconds per step). Rank r's
    time rides at index 4 + r, zeros elsewhere, so the sum gives every rank the whole list."""
    times = torch.zeros(env.world_size, device=env.device)
    times[env.rank] = compute_s
    flags = [float(signals.pending()), float(bool(lease and lease.lost))]
    agreed = torch.cat(
        [
            loss_sum.float().reshape(1),
            (first_bad >= 0).float().reshape(1),
            torch.tensor(flags, device=env.device),
            times,
        ]
    )
    dist.all_reduce(agreed)  # sums (gloo has no AVG)
    loss_total, diverged, stops, lost, *times = agreed.tolist()  # waits for the device: the row's timing is real
    return loss_total, diverged, stops, lost, times


def _agreed_max(group, *values: float) -> list[float]:
    """The largest of each value over the ranks: decisions that every rank must take alike."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class Diverged(Exception):
    """The loss or the gradient norm became NaN or infinite; the message says where and what to do."""


def _stop_if_diverged(first_bad: torch.Tensor, ckpt: manager.Checkpointer, model) -> None:
    """Before a save: raise Diverged on every rank if any rank saw a non-finite loss or gradient norm
    or holds a non-finite weight. The save in flight, started from finite weights, is committed."""
    bad = first_bad.clone().float()
    finite = torch.stack([torch.isfinite(_local(p)).all() for p in model.parameters()]).all()
    bad = torch.where(finite | (bad >= 0), bad, torch.full_like(bad, 1e30))
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item() >= 0:
        _raise_diverged(first_bad, ckpt)


def _raise_diverged(first_bad: torch.Tensor, ckpt: manager.Checkpointer) -> None:
    """Raise Diverged once the ranks agree that one of them diverged (`first_bad`: this rank's step)."""
    ckpt.close()
    where = f"at step {int(first_bad.item())}" if first_bad.item() >= 0 else "on another rank"
    last = f"step {ckpt.last_saved}" if ckpt.last_saved is not None else "none"
    raise Diverged(
        f"training diverged: the loss or gradient norm became NaN or infinite ({where}); nothing after "
        f"it was saved (newest checkpoint: {last}). Lower optim.lr or set train.grad_clip, then resume "
        f"with checkpoint.resume_from=<an earlier checkpoint> in a new run_dir"
    )


def _raise_lease_lost(lease: Lease | None, run_dir: str, step: int, ckpt: manager.Checkpointer) -> None:
    """Raise LeaseLost on every rank once they agree that rank 0 lost the run dir's lease. The save in
    flight is finished but not committed (rank 0's commit checks the lease first)."""
    ckpt.close()
    if lease is None:
        raise LeaseLost(f"lost the lease of run_dir {run_dir} (rank 0 says to whom)")
    raise LeaseLost(
        f"lost the lease of run_dir {run_dir} {lease.lost} at step {step}: this run stopped, and nothing "
        f"was committed or deleted after the loss; two runs must not share a run dir: let that run go on, "
        f"or stop it and start this one again"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's parameters and gradient norm), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _loss_fn(cfg: Config):
    """The training loss, compiled with the model: then the float32 copy of the logits is never
    stored (at 1B parameters, 32k tokens and a 32k vocabulary that is 4 GB less, and faster)."""
    loss = models.spec(cfg.model).loss
    # Under tp the loss runs on DTensor logits in loss_parallel: left to eager, as torchtitan does.
    return torch.compile(loss) if cfg.parallel.compile and cfg.parallel.tp == 1 else loss


def _open_trace(run_dir: str, rank: int):
    folder = os.path.join(run_dir, layout.TRACE_DIR)
    files.make_folder(folder)
    trace = files.open_append(os.path.join(folder, f"rank_{rank:05d}.txt"))
    trace.reconfigure(line_buffering=True)
    return trace


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
