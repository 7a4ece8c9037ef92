"""Held-out figures of the bundled tool task for checkpoints side by side: greedy accuracy with the calculator and with
tools disabled (the same problems, prompted without the tool line, no call run), and the tool-call rate.

The same seams the GRPO loop uses (`build_policy`, `trainer.rollout.Rollout`, `trainer.evaluation.held_out_metrics`),
with `--config tools`' settings; every held-out problem of `data.path=calculator` (500) unless `--samples`.

    .venv/bin/python scripts/tool_task_figures.py outputs/sft-tools/hf outputs/grpo-tools/hf [...] [--samples 500]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import cli  # noqa: E402
from config.loops import GRPOConfig  # noqa: E402
from data import prompts as prompt_data, rewards, tools as tool_data  # noqa: E402
from model import build, generate, parallel  # noqa: E402
from trainer import evaluation, rollout as rollout_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="HF checkpoint directories")
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    config, _ = cli.parse_args(GRPOConfig, ["--config", "tools", f"--model.path={args.models[0]}",
                                            f"--train.eval_samples={args.samples}"], "tool_task_figures")
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    reward, toolset = rewards.get_reward(config.grpo.reward), tool_data.Toolset.from_config(config.grpo)
    rows = []
    for path in args.models:
        tokenizer = build.load_tokenizer(Path(path))
        end_ids = generate.end_token_ids(path, tokenizer)
        config.model.path = path
        policy = build.build_policy(config, Path(path), tokenizer, trainable=False)
        figures = {}
        for name, tools_on in (("with tools", True), ("tools disabled", False)):
            rollout = rollout_data.Rollout.from_config(config, tokenizer, toolset, end_ids, tools_on=tools_on)
            prompts = prompt_data.load_prompts(config.data, tokenizer, config.data.path, "test", config.grpo.max_new_tokens,
                                               tools=rollout.schemas or None)[: args.samples]
            figures[name] = evaluation.held_out_metrics(policy, prompts, reward, runtime, config,
                                                        config.grpo.max_new_tokens, rollout)
        rows.append((path, figures))
    if runtime.is_main:
        print(f"{'checkpoint':40s} {'accuracy with tools':>20s} {'tool-call rate':>15s} {'accuracy, tools disabled':>25s}")
        for path, figures in rows:
            print(f"{path:40s} {figures['with tools']['eval_accuracy']:20.3f} "
                  f"{figures['with tools']['eval_tool_call_rate']:15.3f} {figures['tools disabled']['eval_accuracy']:25.3f}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
