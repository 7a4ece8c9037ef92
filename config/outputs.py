"""What a run writes into `train.out_dir` besides its checkpoints, named once: the code that writes each output and
`train.overwrite_output_dir`, which deletes an earlier run's, both read these names."""

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
PLOT = "metrics.png"
TENSORBOARD = "tb"
HF = "hf"  # the trained model as a Hugging Face checkpoint (with LoRA, the adapters merged)
HF_ADAPTER = "hf_adapter"  # with LoRA, the adapters alone in PEFT format
EXPORTS = (HF, HF_ADAPTER)
RUN_OUTPUTS = (METRICS, SAMPLES, PLOT, TENSORBOARD, *EXPORTS)
# An export is written under this prefix and renamed when complete, so a directory named HF is always whole.
PARTIAL = ".partial-"
