"""Asynchronous GRPO (`grpo.rollout_processes` > 0): the last processes of the torchrun world only sample, each with a
whole replica of the policy; the others train, at any layout, on the batches they are sent.

The schedule is fixed, not a race. The batch of step s is sampled by the policy after step
`sampled_by(s) = max(start, s - 1 - grpo.max_staleness)` (`start`: the step the run began or resumed after), with the
seeds and prompts the colocated loop uses for each data-parallel rank (`trainer.grpo_sampling`), so which policy
samples what is a pure function of (train.seed, step) and a run repeats bit for bit. Every message has its place:
- trainers, at start: push the policy's weights (version `start`);
- trainers, after step s: receive the batches of steps up to s + max_staleness (each sampled by a version already
  pushed), then push version s when a later batch needs it (s + 1 + max_staleness <= train.steps);
- a rollout process: for each step from its first, wait for the version that samples it (taking pushes in order),
  sample and score the batches of the data-parallel ranks it serves (rank d is served by rollout process
  d mod grpo.rollout_processes), send each to that rank's trainers.
With max_staleness 1 the rollout processes sample step s+1 while step s trains; with 0 the two sides take turns. A
checkpoint after step s holds the batches already received for steps s+1..s+k (`state_dict`): they were sampled by
policies the checkpoint no longer has, so they are saved rather than regenerated, and a resume continues exactly.
A failure on a rollout process (a reward or tool error that stops the run, a bug) is sent to its trainers as a
paragraph and raised on both sides; torchrun stops the rest. A stop signal to a rollout process alone (its node
preempted) rides on its next batch: the trainers stop at that step's end and save, as for a signal of their own, and
the rollout process serves what they still wait for, then ends."""

import dataclasses
import logging
import time

from ckpt.resume import changed_settings
from ckpt.signals import catch_stop_signals
from config import cli
from config.errors import UserError
from model import collectives, link as links, parallel
from trainer.grpo_sampling import StepBatch, collect_rollouts, refuse_a_batch_of_skipped_prompts

log = logging.getLogger(__name__)


def sampled_by(step: int, start: int, staleness: int) -> int:
    """The policy version (steps trained) that samples step `step`'s batch."""
    return max(start, step - 1 - staleness)


def sampling_settings(config) -> dict:
    """What a batch sampled ahead was sampled and scored under: the `grpo` and `data` sections (some of whose keys
    only shape the loss: a change of them drops the batches too, which costs a resample, never a wrong step)."""
    settings = cli.to_dict(config)
    return {"grpo": settings["grpo"], "data": settings["data"]}


def served_by(process: int, rollouts: int, trainer_dp: int) -> range:
    """The data-parallel ranks rollout process `process` samples for: rank d is served by process d mod `rollouts`."""
    return range(process, trainer_dp, rollouts)


class RemoteRollouts:
    """The trainers' side: the batches the rollout processes send, the weights pushed to them, and the batches
    received ahead of their step (a checkpoint part: `state_dict` / `load_state_dict`)."""

    def __init__(self, config, runtime, policy):
        self.link, self.policy, self.runtime, self.config = runtime.link, policy, runtime, config
        self.staleness, self.steps = config.grpo.max_staleness, config.train.steps
        self.source = runtime.link.trainers + runtime.dp_rank % runtime.link.rollouts  # the rollout process serving me
        self.pending: dict[int, StepBatch] = {}  # step -> its batch, received ahead
        self.received = self.pushed = 0  # the last step whose batch came; the last version pushed
        if self.staleness and config.grpo.rollout_correction == "none" and runtime.is_main:  # set so explicitly
            log.warning("grpo.max_staleness=%d trains on rollouts up to %d updates old with no correction for it: the "
                        "clipped ratio is taken against the proximal policy only (AReaL measured naive PPO losing "
                        "accuracy from 4 steps of staleness; here one step cost 0.937 -> 0.674 held-out). "
                        "`--grpo.rollout_correction=tis` (or auto, the default) is the decoupled objective.",
                        self.staleness, self.staleness)

    def checkpoint_parts(self) -> dict:
        return {"rollouts": self}  # the batches received ahead

    def state_dict(self) -> dict:
        """Every data-parallel rank's batches received ahead (collective over the data-parallel group), and the
        settings they were sampled and scored under."""
        return {"batches": collectives.data_parallel_gather(self.pending), "sampled_with": sampling_settings(self.config)}

    def load_state_dict(self, state: dict | None) -> None:
        """The checkpoint's batches sampled ahead, kept where this run would have sampled them alike: the same
        data-parallel ranks and sampling settings. Otherwise they are dropped and the checkpoint's policy samples those
        steps again (`sampled_by` from the resumed step), under this run's settings: a batch sampled at another
        `grpo.max_staleness` or temperature, or scored by another reward, would train as if it were this run's."""
        batches, sampled_with = (state or {}).get("batches"), (state or {}).get("sampled_with")
        changed = changed_settings(sampled_with, sampling_settings(self.config)) if batches and sampled_with else {}
        if any(batches or []) and changed:
            if self.runtime.is_main:
                log.warning("the checkpoint's batches sampled ahead were sampled and scored with settings this run "
                            "changes (%s): they are dropped, and the checkpoint's policy samples those steps again",
                            ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in changed.items()))
            return
        if batches and len(batches) == self.runtime.dp_size:
            self.pending = batches[self.runtime.dp_rank]
        elif batches is not None:
            log.warning("the checkpoint's batches sampled ahead are for %d data-parallel ranks, this run has %d: the "
                        "next steps are sampled by the checkpoint's policy instead", len(batches), self.runtime.dp_size)

    def begin(self, start: int) -> None:
        """Push the starting policy (version `start`) with what the rollout processes need to know; collective over
        the trainers."""
        self.received = start + len(self.pending)
        dp_ranks = collectives.world_gather(self.runtime.dp_rank)
        if self.runtime.is_main:  # a rollout process is never rank 0, and prints only its errors and own warnings
            rollouts, trainer_dp = self.link.rollouts, max(dp_ranks) + 1
            served = [list(served_by(process, rollouts, trainer_dp)) for process in range(rollouts)]
            log.info("from step %d, %s", self.received + 1, "; ".join(
                f"rollout process {process} samples for data-parallel ranks {ranks}"
                for process, ranks in enumerate(served)))
        self._push(start, {"first": self.received + 1, "start": start, "dp_ranks": dp_ranks})

    def take(self, step: int, timer) -> StepBatch:
        """Step `step`'s batch (received now, or ahead), the wait timed as the step's `rollout_wait` phase."""
        with timer.phase("rollout_wait"):
            self._receive_through(step)
        step_batch = self.pending.pop(step)
        if step_batch.route_layers is not None:  # a replica's routes cover every layer; a pipeline stage replays its own
            routes = self.policy.routes
            step_batch.routes = routes.narrowed(step_batch.routes, step_batch.route_layers) if routes else None
            step_batch.route_layers = routes.layer_numbers if routes else None
        refuse_a_batch_of_skipped_prompts(step_batch, self.config, step)
        return step_batch

    def after_update(self, step: int, timer) -> None:
        """The batches up to step + max_staleness (sampled by versions already pushed), then version `step` if a
        later batch needs it; timed as `rollout_wait` and `weight_sync`."""
        with timer.phase("rollout_wait"):
            self._receive_through(min(step + self.staleness, self.steps))
        if step + 1 + self.staleness <= self.steps:
            with timer.phase("weight_sync"):
                self._push(step, {})

    def close(self) -> None:
        """After the loop (finished or stopped): the batches still in flight (sampled by a version pushed), then the
        end, so no rollout process waits for a message that never comes."""
        self._receive_through(min(self.steps, self.pushed + 1 + self.staleness))
        if self.link.weights is not None:
            self.link.broadcast_object({"stop": True})

    def _receive_through(self, last: int) -> None:
        while self.received < last:
            message = self.link.receive(self.source)
            if isinstance(message, str):  # the rollout process failed: its paragraph
                raise UserError(message)
            self.received += 1
            self.pending[self.received] = message
            if message.stop_requested:  # its rollout process was signalled: stop as if this process were
                message.stop_requested = False  # not again on resume, where a checkpoint holds it received ahead
                if not catch_stop_signals().requested and self.runtime.is_main:
                    log.info("rollout process %d had a stop signal: the trainers stop after this step, and save",
                             self.source - self.link.trainers)
                catch_stop_signals().pass_on()

    def _push(self, version: int, header: dict) -> None:
        links.push_weights(self.policy, self.link, {"version": version, **header})
        self.pushed = version


def end_without_steps(runtime) -> None:
    """Trainers with nothing to run (a finished run resumed): tell the rollout processes, which wait for weights."""
    if runtime.link is None:
        return
    if runtime.link.weights is not None:
        runtime.link.broadcast_object({"stop": True})
    parallel.shutdown(runtime)


def serve(config, runtime, replica, episode_sampler, prompts, reward) -> None:
    """A rollout process's loop (see the module's schedule): until the trainers' end message, receive weights, sample
    and score the batches of the data-parallel ranks this process serves, send each to their trainers."""
    link, staleness = runtime.link, config.grpo.max_staleness
    header = links.receive_header(link)
    if header.get("stop"):  # the trainers had nothing to run
        return
    links.receive_weights(replica, link)
    version, start, dp_ranks = header["version"], header["start"], header["dp_ranks"]
    trainer_dp = max(dp_ranks) + 1
    served = served_by(runtime.dp_rank, link.rollouts, trainer_dp)
    blocked = 0.0  # the last step's sends, blocked until the trainers took the batches: idle, told with the next
    for step in range(header["first"], config.train.steps + 1):
        idle, waited = blocked, time.perf_counter()
        while version < sampled_by(step, start, staleness):
            header = links.receive_header(link)
            idle += time.perf_counter() - waited  # waiting for the trainers' update; loading its weights is work
            if header.get("stop"):
                return
            links.receive_weights(replica, link)
            version, waited = header["version"], time.perf_counter()
        idle, blocked = idle + time.perf_counter() - waited, 0.0
        for dp_rank in served:
            trainers = [rank for rank, rank_dp in enumerate(dp_ranks) if rank_dp == dp_rank]
            batch = _sample(config, dataclasses.replace(runtime, dp_rank=dp_rank, dp_size=trainer_dp), replica,
                            episode_sampler, prompts, reward, step, trainers)
            # The wait is this process's, once: the rows' sum over batches is then every rollout process's.
            batch.version, batch.sampler_idle_s = version, idle if dp_rank == served[0] else 0.0
            batch.stop_requested = catch_stop_signals().requested  # this node preempted: the trainers stop and save
            sending = time.perf_counter()
            for rank in trainers:
                link.send(batch, rank)
            blocked += time.perf_counter() - sending
    while not links.receive_header(link).get("stop"):  # the trainers push nothing more; their end message
        links.receive_weights(replica, link)


def _sample(config, view, replica, episode_sampler, prompts, reward, step: int, trainers: list[int]) -> StepBatch:
    """One data-parallel rank's batch of `step`; a failure is sent to its `trainers` as a paragraph, and raised."""
    try:
        return collect_rollouts(replica, episode_sampler, prompts, config, step, view, reward)
    except Exception as error:  # noqa: BLE001 - every failure reaches the trainers, which would otherwise wait
        paragraph = str(error) if isinstance(error, UserError) else (
            f"A rollout process failed sampling step {step} for data-parallel rank {view.dp_rank}: "
            f"{type(error).__name__}: {error} (its traceback is in that process's log).")
        if not isinstance(error, UserError):
            log.exception("rollout process failed")
        for rank in trainers:
            view.link.send(paragraph, rank)
        raise UserError(paragraph) from None
