"""Which synthetic presets a sweep replays.

CI runs each sweep (streamed against in memory, split across processes, minimized) over a representative set:
one preset for each thing a sweep can break, not every incident, so the suite fits CI's budget on two cores.
`--all` runs every preset `nanreplay synth --help` lists (bench/sweep_presets.sh does, for all three sweeps).
Standard library only.
"""

# One preset per mechanism a replay path treats differently.
REPRESENTATIVE = {
    # precisions: fp32, bf16, fp16 with its loss scaler, fp8 scales
    "clean-fp32", "clean-bf16", "clean-fp16", "head-overflow", "loss-scale-overflow", "fp8-scale-jump",
    # families and options: gpt2, Qwen3's QK-norm, Gemma 2's caps and window, all llama options, MoE
    "clean-gpt2", "clean-qwen3", "clean-gemma2", "clean-combined", "clean-moe", "router-overflow",
    "expert-overflow",
    # batches: data-parallel ranks, accumulation, a fault on one rank
    "clean-dp", "clean-accum", "glitch-token", "rank-mismatch",
    # trajectories and checkpoints: a NaN that spreads, a skipped step, flipped bits (NaN, silent), and a
    # logged NaN the replay does not reproduce
    "cascade", "transient-fp16", "bit-flip", "silent-bit-flip", "not-reproducible",
    # data: a zero embedding, an id out of range
    "zero-embedding", "token-out-of-range",
}


def add_all_flag(parser):
    parser.add_argument("--all", action="store_true",
                        help="every preset synth lists, not the representative set CI runs")


def swept(presets, everything, listed=None):
    """`presets` in their order, cut to the representative set unless `everything`. With `listed` (synth's
    presets), a representative name synth no longer lists raises: the set must follow renames."""
    if listed is not None:
        gone = sorted(REPRESENTATIVE - set(listed))
        if gone:
            raise SystemExit(f"preset_sweep.REPRESENTATIVE names presets synth does not list: {gone}")
    return [p for p in presets if everything or p in REPRESENTATIVE]
