"""What the loops report: metrics.jsonl and the console line (printed by rank 0: `config.console`), step time, MFU."""

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from ckpt.layout import LATEST, checkpoint_dir
from config import outputs
from config.errors import AgreedStop, UserError

log = logging.getLogger("trainer")

# bf16 dense peak FLOP/s by GPU name, for the MFU estimate; the first key the name contains wins, so a variant with
# its own peak (the PCIe and NVL cards run lower clocks and power) comes before its family.
PEAK_BF16_FLOPS = {"H200 NVL": 835e12, "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
                   "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def model_flops_per_token(hf_config: dict, seq_length: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token (forward + backward): 6 x the matmul parameters a token passes through plus causal
    attention scores. A Mixture-of-Experts layer counts its router, its top-k routed experts and any shared expert (the
    work a token does), not every expert. `frozen_base` (LoRA): the frozen weights take no weight-gradient product, so
    4 x their parameters (forward and input gradient), the adapters' own small products left out, as Megatron-Bridge's
    LoRA figure does."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads  # Qwen3, Mistral: set apart from hidden / heads
    attention = hidden * head_dim * (heads * 2 + kv_heads * 2)  # q, o, k, v projections
    mlp = sum(_mlp_parameters_per_token(hf_config, layer) for layer in range(layers))
    matmul_parameters = layers * attention + mlp + hidden * hf_config["vocab_size"]
    # QK^T and attention x V: 2 matmuls, causal halves them, x3 for forward + backward.
    attention_scores = 3 * layers * 2 * 2 * seq_length * heads * head_dim / 2
    return (4 if frozen_base else 6) * matmul_parameters + attention_scores


def _mlp_parameters_per_token(hf_config: dict, layer: int) -> int:
    """The MLP weights one token multiplies in `layer` (gate, up, down): a dense MLP's, or a Mixture-of-Experts layer's
    router, top-k routed experts and shared expert (transformers' rule of which layers are sparse)."""
    hidden = hf_config["hidden_size"]
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0
    sparse = (experts > 0 and layer not in (hf_config.get("mlp_only_layers") or [])
              and (layer + 1) % (hf_config.get("decoder_sparse_step") or 1) == 0)
    if not sparse:
        return 3 * hidden * hf_config["intermediate_size"]
    expert_size = hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]
    shared = hf_config.get("shared_expert_intermediate_size") or 0
    return hidden * experts + hf_config["num_experts_per_tok"] * 3 * hidden * expert_size + 3 * hidden * shared


def peak_flops() -> float | None:
    """The bf16 dense peak of this GPU, or None (CPU, or a GPU not in the table)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


class MetricsWriter:
    """Rank 0's record of a run: metrics.jsonl (one object per step), the console line, TensorBoard and W&B when
    switched on (`log.*`), GRPO's sampled completions, and metrics.png when the run ends."""

    def __init__(self, config, is_main: bool, start_step: int):
        self.is_main, self.train, self.start_step = is_main, config.train, start_step
        self.out_dir, self.checkpoints = Path(config.train.out_dir), checkpoint_dir(config)
        self.step, self.failed = start_step, False  # the last step written; whether a write failed (said once)
        self.file = self.samples_file = self.progress = None
        self.loggers = []
        if is_main:
            from tqdm import tqdm

            with self._writing(self.out_dir / outputs.METRICS):  # a resume rewrites the rows it keeps
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self.file = _continue_file(self.out_dir / outputs.METRICS, start_step)
            if (self.out_dir / outputs.SAMPLES).exists():  # a stopped run's samples past the checkpoint go now, as its
                with self._writing(self.out_dir / outputs.SAMPLES):  # rows do, not at the first logged step
                    self.samples_file = _continue_file(self.out_dir / outputs.SAMPLES, start_step)
            self.progress = tqdm(total=config.train.steps, initial=start_step, desc="train", unit="step",
                                 dynamic_ncols=True, file=sys.stderr, disable=not sys.stderr.isatty())
            if config.log.tensorboard:
                with self._writing(self.out_dir / outputs.TENSORBOARD):
                    self.loggers.append(TensorBoardLogger(self.out_dir, start_step))
            if config.log.wandb:
                self.loggers.append(WandbLogger(config, self.out_dir, start_step))

    def write(self, row: dict) -> None:
        """Append one row and send its scalars to every logger; a console line on logged steps and evaluation rows."""
        if not self.is_main:
            return
        self.step = row["step"]
        with self._writing(self.out_dir / outputs.METRICS):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        for logger in self.loggers:
            with self._writing(logger.directory):
                logger.scalars(row["step"], _scalars(row))
        if self.progress is not None and "loss" in row:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
        if self.train.logs_at(row["step"]) or "eval_loss" in row or "loss" not in row:
            shown = {key: value for key, value in row.items() if key != "step"}
            text = " ".join(f"{key}={_short(value)}" for key, value in shown.items())
            (self.progress.write if self.progress is not None else print)(f"step {row['step']}: {text}")

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """A few completions of one step (prompt, completion, reward, ...) to samples.jsonl and, as text, to the loggers."""
        if not self.is_main or not samples:
            return
        with self._writing(self.out_dir / outputs.SAMPLES):
            if self.samples_file is None:  # opened on first use: only GRPO writes samples
                self.samples_file = _continue_file(self.out_dir / outputs.SAMPLES, self.start_step)
            self.samples_file.write("".join(json.dumps({"step": step, **sample}) + "\n" for sample in samples))
            self.samples_file.flush()
        for logger in self.loggers:
            with self._writing(logger.directory):
                logger.samples(step, samples)

    @contextlib.contextmanager
    def _writing(self, path: Path):
        """A failure to write rank 0's record at `path` (a full disk, a quota, permissions) as the one paragraph that
        stops the run; a later one (closing the same file on the way out) is not said again."""
        try:
            yield
        except OSError as error:
            if self.failed:
                return
            self.failed = True
            pointer = self.checkpoints / LATEST
            latest = (f"`latest` in `{self.checkpoints}` names `{pointer.read_text().strip()}`, the last complete "
                      "checkpoint" if pointer.is_file() else f"`latest` in `{self.checkpoints}` names no checkpoint yet")
            raise UserError(f"Writing `{path}` failed at step {self.step}: {' '.join(str(error).split())}. The run "
                            f"stops here; {latest}. Make room in `{path.parent}` (or fix what the error names) and "
                            "continue with `--resume-from-checkpoint latest`.") from None

    def close(self, draw: bool = True) -> None:
        """Flush and close the files, the bar and the loggers; then draw metrics.png from metrics.jsonl."""
        if not self.is_main:
            return
        failure = None
        if self.progress is not None:
            self.progress.close()
        for handle, path in ((self.file, self.out_dir / outputs.METRICS), (self.samples_file, self.out_dir / outputs.SAMPLES),
                             *((logger, logger.directory) for logger in self.loggers)):
            try:
                with self._writing(path):  # closing flushes what a failed write left in the buffer: said once
                    if handle is not None:
                        handle.close()
            except UserError as error:  # every handle is closed before it is raised
                failure = failure or error
        if failure is not None:
            raise failure
        if draw:
            from trainer import plots

            # A picture is a by-product: a failure to draw is reported and never fails the finished run.
            try:
                plots.draw_runs([self.out_dir], self.out_dir / outputs.PLOT)
            except Exception as error:  # noqa: BLE001
                log.warning("metrics.png was not written: %s: %s", type(error).__name__, error)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.failed = self.failed or exc_type is not None  # a run failing already says its own error, not the close's
        self.close(draw=exc_type is None)


def stop_if_diverged(row: dict, writer: MetricsWriter, checkpointer) -> None:
    """Stop the run at a step whose gradient norm is NaN or infinite, before anything the step produced is evaluated or
    saved: its row is written and the save in flight (the weights before it) published, then one paragraph. In fp32
    and bf16 megatron-core applies such an update (fp16's overflows it skips: `grad_norm` None), so every later step,
    checkpoint and export would carry NaN weights, and rotate the good checkpoints out. The norm is megatron-core's
    global one, the same on every rank, so every rank stops at the same step (the wait is collective). An fp16 update
    skipped on a loss that is not a number (a forward that overflowed, from finite weights) stops the same way, as
    Megatron-LM's loss check does: the scale cannot mend a forward, and the run would skip on through every step."""
    grad_norm, loss = row.get("grad_norm"), row.get("loss")
    bad_loss = isinstance(loss, float) and not math.isfinite(loss)
    if grad_norm is None and not bad_loss or grad_norm is not None and math.isfinite(grad_norm):
        return
    writer.write(row)
    checkpointer.wait()  # as `Checkpointer.kept_on_agreed_stop` would, first: the paragraph names what it published
    latest = checkpointer.directory / LATEST
    kept = (f"the last checkpoint, `{checkpointer.directory / latest.read_text().strip()}`, holds the weights before "
            "it" if latest.is_file() else "no checkpoint was saved before it")
    # The step before left finite weights (its norm was finite), so a loss that is not a number came with the inputs.
    advice = ("Its loss was already not a number, computed from the finite weights the step before left, so the cause "
              "is in what the step fed it (in GRPO a reward model's scores or a teacher's log-probs) or an overflow in "
              "its forward (in fp16, whose range ends at 65504, try `model.dtype=bf16`; in bf16, `model.dtype=fp32`): "
              "mend it" if bad_loss else
              "Lower `optim.lr`, lengthen `optim.warmup_steps` or keep `optim.clip_grad` on (1 by default)")
    if grad_norm is None:
        raise AgreedStop(
            f"Training stopped at step {row['step']}: its loss is {loss} (learning rate {row['lr']:.4g}), and fp16's "
            "loss scale skipped its update (the weights stay as they were), as it would every step whose forward "
            f"overflows. The step's row is the last in `{writer.out_dir / outputs.METRICS}`, and {kept}. {advice}, "
            "and start again in a new `train.out_dir`.")
    raise AgreedStop(
        f"Training diverged at step {row['step']}: the gradient norm is {grad_norm} (learning rate {row['lr']:.4g}"
        f"{f', loss {loss:.4g}' if isinstance(loss, float) else ''}), so the weights this step updated are no longer "
        f"numbers. The run stops without saving them: the step's row is the last in "
        f"`{writer.out_dir / outputs.METRICS}`, and {kept}. {advice}, and start again in a new `train.out_dir`.")


def _continue_file(path: Path, start_step: int):
    """`path` opened for appending rows: a resumed run keeps the rows up to its checkpoint's step (those a stopped run
    wrote past it are replaced by the rerun's); a fresh run starts a new file."""
    kept = [row for row in (outputs.read_rows(path) if start_step else []) if row.get("step", 0) <= start_step]
    outputs.write_rows(path, kept)
    return open(path, "a")


def _scalars(row: dict) -> dict:
    """The numbers of a metrics row, what the loggers take (`step` is their x axis)."""
    return {key: value for key, value in row.items() if key != "step" and _is_number(value)}


def _is_number(value) -> bool:
    """Scalars the loggers take: ints and floats (None, e.g. `kl` without a KL penalty, is left out)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardLogger:
    """Scalars under their metrics.jsonl names, and samples as a text table, in `<train.out_dir>/tb/`."""

    def __init__(self, out_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run hides what a stopped run logged from its checkpoint's step on (TensorBoard's purge_step), and
        # logs that step again from metrics.jsonl and samples.jsonl, once: a row the checkpoint restored to
        # metrics.jsonl (a run that died in its final export, after the save) had never reached TensorBoard. A run that
        # starts from step 0 over a killed one's events (no `latest` to resume) hides them all, as metrics.jsonl does.
        self.directory = out_dir / outputs.TENSORBOARD
        self.writer = SummaryWriter(str(self.directory), purge_step=start_step)
        for row in outputs.read_rows(out_dir / outputs.METRICS) if start_step else []:
            if row.get("step") == start_step:
                self.scalars(start_step, _scalars(row))
        samples = [row for row in outputs.read_rows(out_dir / outputs.SAMPLES) if start_step and row.get("step") == start_step]
        if samples:
            self.samples(start_step, [{key: value for key, value in row.items() if key != "step"} for row in samples])

    def scalars(self, step: int, scalars: dict) -> None:
        """One step's scalars."""
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def samples(self, step: int, samples: list[dict]) -> None:
        """One step's samples as a markdown table (TensorBoard's Text tab)."""
        columns = list(samples[0])
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(sample[column]) for column in columns) + " |" for sample in samples]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        """Flush the event file."""
        self.writer.close()


class WandbLogger:
    """Scalars under their metrics.jsonl names, and samples as a table, in a Weights & Biases run.

    W&B's environment variables apply (WANDB_MODE=offline writes `<train.out_dir>/wandb/offline-run-*` without a
    network; `wandb sync` uploads it later). A resumed run continues the W&B run of the same output directory.
    """

    def __init__(self, config, out_dir: Path, start_step: int):
        import wandb

        from config.cli import to_dict

        self.directory = out_dir / "wandb"
        id_file = self.directory / "trainer-run-id"
        run_id = id_file.read_text().strip() if start_step and id_file.is_file() else None
        try:
            self.run = wandb.init(project=config.log.wandb_project or os.environ.get("WANDB_PROJECT") or "megatron-trainer",
                                  name=config.log.wandb_name or None, dir=str(out_dir), config=to_dict(config),
                                  id=run_id, resume="allow" if run_id else None)
        except wandb.errors.UsageError as error:  # no API key (and not offline): before any step, not a traceback
            raise UserError(f"`log.wandb=true`: W&B refused to start ({error}). Log in with `wandb login`, or write the "
                            "run locally with `WANDB_MODE=offline` (`wandb sync` uploads it later), or leave "
                            "`log.wandb` off.") from None
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)

    def scalars(self, step: int, scalars: dict) -> None:
        """One step's scalars."""
        self.run.log(scalars, step=step)

    def samples(self, step: int, samples: list[dict]) -> None:
        """One step's samples as a W&B table."""
        import wandb

        columns = list(samples[0])
        self.run.log({"samples": wandb.Table(columns=columns, data=[[sample[column] for column in columns] for sample in samples])},
                     step=step)

    def close(self) -> None:
        """Finish the run (offline: the run directory is complete)."""
        self.run.finish()


def _short(value):
    """Compact number formatting for console lines."""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return value


def _synchronize() -> None:
    """Wait for the GPU's queued kernels, so the clock that reads next counts them."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer:
    """Wall time of one step, and of named phases inside it (`phase`), synchronising the GPU so queued kernels count."""

    def __init__(self):
        self.phases, self.seconds = {}, 0.0  # phases can be timed outside a `with` too (benchmarks)

    def __enter__(self):
        _synchronize()
        self.start, self.phases = time.perf_counter(), {}
        return self

    def __exit__(self, *exc):
        _synchronize()
        self.seconds = time.perf_counter() - self.start

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as `<name>_time_s` in `phase_seconds()`."""
        _synchronize()
        start = time.perf_counter()
        yield
        _synchronize()
        self.phases[f"{name}_time_s"] = self.phases.get(f"{name}_time_s", 0.0) + time.perf_counter() - start


def timed(name: str, function, *args, into: dict):
    """`function(*args)`, its seconds (queued GPU work included) put into `into` as `<name>_time_s`: the work
    between two steps (evaluation, a checkpoint's save) in the step's row."""
    with StepTimer() as timer:
        result = function(*args)
    into[f"{name}_time_s"] = timer.seconds
    return result


def peak_memory_gib() -> dict:
    """{"peak_memory_gib": this process's high-water mark of allocated tensors so far} on a GPU; {} elsewhere."""
    return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available() else {}


def process_age() -> float:
    """Seconds since this process started (interpreter start-up and imports included), from /proc on Linux."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class StartupTimes:
    """Where the time before the first step goes: wall and CPU seconds per phase, reported once by rank 0.

    The first phase runs from the process's own start to `main()`: the interpreter and the module imports. CPU
    seconds (this process, all threads) say what the phase costs on a machine shared with other work.
    """

    def __init__(self):
        self.seconds = {"python and imports": (process_age(), time.process_time())}
        self.last = (time.perf_counter(), time.process_time())

    def mark(self, phase: str) -> None:
        """Close `phase`: the time since the previous mark is its."""
        now = (time.perf_counter(), time.process_time())
        wall, cpu = self.seconds.get(phase, (0.0, 0.0))
        self.seconds[phase] = (wall + now[0] - self.last[0], cpu + now[1] - self.last[1])
        self.last = now

    def report(self) -> str:
        """Log (rank 0) and return the one-line breakdown."""
        total_wall, total_cpu = (sum(seconds[index] for seconds in self.seconds.values()) for index in (0, 1))
        parts = ", ".join(f"{phase} {wall:.1f}/{cpu:.1f}" for phase, (wall, cpu) in self.seconds.items())
        line = f"start-up before the first step, wall/CPU seconds: {total_wall:.1f}/{total_cpu:.1f} ({parts})"
        log.info(line)
        return line
