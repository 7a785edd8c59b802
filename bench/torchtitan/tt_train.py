"""torchrun entry point: torchtitan 0.2.2's own trainer, with our 1B shape registered as a llama3 flavor.

    torchrun --standalone --nproc-per-node=1 bench/torchtitan/tt_train.py \
        --job.config_file bench/torchtitan/llama1b.toml [torchtitan overrides]

torchtitan's installed files are not edited. Before calling torchtitan.train.main(Trainer) this
  1. adds "llama1b_32k" to torchtitan.models.llama3.llama3_args (the dict the llama3 TrainSpec serves);
  2. checks the shape on the meta device (FFN 8192, parameter count, FLOPs/token) and that the
     tokenizer has exactly the flavor's vocab size, and prints what it found;
  3. loads the dataset the way torchtitan will (c4_test loader = datasets.load_dataset(dir, split="train")),
     so a broken datasets/pyarrow install fails here, before the model is built.
Env:
  TT_FSDP1=1  also wrap the model with torchtitan's own apply_fsdp (fully_shard, bf16 params, fp32
              reduce) on a 1-rank mesh and drop autocast, as our FSDP2 trainer does on one GPU.
              Default 0: torchtitan's stock single-GPU path (no FSDP, torch.autocast(bfloat16)).
"""

import contextlib
import os
import sys

import torch
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

FLAVOR = "llama1b_32k"
llama3_args[FLAVOR] = TransformerModelArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=32000,
    # FeedForward hidden: int(2*(4*2048)/3) = 5461; int(1.5*5461) = 8191; 256*ceil(8191/256) = 8192
    multiple_of=256,
    ffn_dim_multiplier=1.5,
    norm_eps=1e-5,
    rope_theta=10000,
    # scaling_factor 1 makes the llama3.1 frequency scaling the identity: plain RoPE, as ours
    rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
)


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(msg: str) -> None:
    if _rank0():
        print(f"[tt_train] {msg}", flush=True)


def check_model(flavor: str, seq_len: int) -> None:
    from torchtitan.models.llama3.model.model import Transformer

    args = llama3_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    n_total = sum(p.numel() for p in model.parameters())
    n_emb = model.tok_embeddings.weight.numel()
    ffn = model.layers["0"].feed_forward.w1.out_features
    # torchtitan: 6*(N - embedding) + 6*L*H*(2*head_dim)*T ; ours: 6*N_nonemb + 12*L*dim*T (the same)
    ours = 6 * (n_total - n_emb) + 12 * args.n_layers * args.dim * seq_len
    say(
        f"flavor {flavor}: dim {args.dim} layers {args.n_layers} heads {args.n_heads} kv_heads "
        f"{args.n_kv_heads} ffn {ffn} vocab {args.vocab_size} rope_theta {args.rope_theta}; "
        f"params {n_total:,} (non-embedding {n_total - n_emb:,}); "
        f"FLOPs/token at seq {seq_len} (our formula) {ours:,}"
    )
    if flavor == FLAVOR:
        assert ffn == 8192, ffn


def check_tokenizer(path: str, vocab_size: int) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(path)
    n = tok.get_vocab_size()
    ids = tok.encode("hello world", add_bos=True, add_eos=True)
    say(f"tokenizer {path}: vocab {n}, bos {tok.bos_id}, eos {tok.eos_id}, sample {ids}")
    if n != vocab_size:
        raise SystemExit(f"tokenizer vocab {n} != model vocab {vocab_size}")


def check_dataset(name: str, path: str | None) -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if name.lower() not in DATASETS or not path:
        return
    ds = DATASETS[name.lower()].loader(path)
    say(f"dataset {name} from {path}: {type(ds).__name__}, {len(ds)} documents (torchtitan's loader)")


def force_fsdp_on_one_rank() -> None:
    """TT_FSDP1=1: fully_shard on a 1-rank mesh (torchtitan's apply_fsdp), no autocast."""
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3 as llama3
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, parallelize_llama
    from torchtitan.tools import utils

    def parallelize(model, parallel_dims, job_config):
        model = parallelize_llama(model, parallel_dims, job_config)
        if not parallel_dims.fsdp_enabled and parallel_dims.world_size == 1:
            mesh = init_device_mesh(utils.device_type, (1,), mesh_dim_names=("fsdp",))
            apply_fsdp(
                model,
                mesh,
                param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
                pp_enabled=False,
                cpu_offload=job_config.training.enable_cpu_offload,
                reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            )
            say("TT_FSDP1: applied torchtitan's apply_fsdp on a 1-rank mesh")
        return model

    def no_amp(*args, **kwargs):
        say("TT_FSDP1: mixed precision by fully_shard, autocast off")
        return contextlib.nullcontext()

    llama3.parallelize_llama = parallelize  # get_train_spec() reads this module global
    dist_utils.maybe_enable_amp = no_amp  # train.py calls dist_utils.maybe_enable_amp(...)


def main() -> None:
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(sys.argv[1:])  # the same parse torchtitan's main does
    say(f"torch {torch.__version__}, argv {sys.argv[1:]}")
    if cfg.model.name == "llama3" and cfg.model.flavor in llama3_args:
        check_model(cfg.model.flavor, cfg.training.seq_len)
        check_tokenizer(cfg.model.hf_assets_path, llama3_args[cfg.model.flavor].vocab_size)
    check_dataset(cfg.training.dataset, cfg.training.dataset_path)
    if os.environ.get("TT_FSDP1", "0") == "1":
        force_fsdp_on_one_rank()

    from torchtitan.train import Trainer
    from torchtitan.train import main as tt_main

    tt_main(Trainer)


if __name__ == "__main__":
    main()
