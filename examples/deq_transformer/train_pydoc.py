"""Train the tiny DEQ-Transformer (or its explicit baseline) on Python's pydoc topics.

Reproduces ``model_cards/deq-transformer-tiny-pydoc`` (Bai et al.'s pre-LN block, implicit differentiation):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --pre-lnorm \\
        --out model_cards/deq-transformer-tiny-pydoc

The explicit baseline (2 untied blocks with d_inner shrunk to match the DEQ's parameter count, same steps,
batch and segment length, so the same tokens):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --explicit \\
        --out /tmp/explicit-pydoc

Jacobian regularization (one Hutchinson sample per step):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --pre-lnorm --jac-reg 0.03 \\
        --out /tmp/deq-jr-pydoc

The byte-level BPE tokenizer (``tokenizers``, 1024 tokens) is trained on the training topics only and saved
into the checkpoint, so ``AutoTokenizer`` and ``pipeline("text-generation")`` load it.

``--corpus pydoc+stdlib`` trains on the pydoc topics plus the standard library's source
(``examples/deq_transformer/pystd_lm.py``: data, split, evaluation); the commands of
``model_cards/deq-transformer-small-pystd`` and its explicit twin are in that card. Long runs save a
resumable state (model, Adam moments, RNG, step; safetensors + JSON) every ``--save-every`` steps into
``--state-dir`` and continue from it with ``--resume`` (the memory of past equilibria restarts empty).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_transformer import pydoc_lm, pystd_lm

EOS = "<|endoftext|>"
TRAIN_DEQ = {"f_solver": "anderson", "f_max_iter": 14, "f_tol": 1e-3, "b_mode": "ift", "b_solver": "anderson",
             "b_max_iter": 10, "b_tol": 1e-3}
EVAL_DEQ = {"f_max_iter": 30, "f_tol": 1e-3}


def train_tokenizer(vocab_size: int, corpus: str = "pydoc"):
    """Byte-level BPE on the training split, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    task = pystd_lm if corpus == "pydoc+stdlib" else pydoc_lm
    tok.train_from_iterator([task.split_text("train")], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=1_000_000)


def build_config(args, tokenizer) -> DEQTransformerConfig:
    common = dict(vocab_size=len(tokenizer), d_model=args.d_model, n_head=args.n_head,
                  d_head=args.d_model // args.n_head, tgt_len=args.seg,
                  mem_len=args.seg, dropout=args.dropout, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                  architectures=["DEQTransformerForCausalLM"])
    if args.explicit:
        # 2 untied blocks; d_inner chosen so the parameter count matches the DEQ (see the card)
        return DEQTransformerConfig(**common, d_inner=args.explicit_d_inner,
                                    explicit_layers=args.explicit_layers, pre_lnorm=args.pre_lnorm,
                                    deq=TRAIN_DEQ)
    deq = {**TRAIN_DEQ, "f_max_iter": args.train_f_iter, "jac_reg_samples": 1 if args.jac_reg > 0 else 0}
    if args.b_mode == "phantom":  # phantom gradient (Geng et al. 2021): k damped unrolled steps from z*
        deq.update(b_mode="phantom", b_mode_kwargs={"k": args.phantom_k, "tau": args.phantom_tau})
    if args.b_mode == "jacobian_free":  # JFB (Fung et al. 2022): the gradient of one f step at z*
        deq.update(b_mode="jacobian_free")
    if args.b_mode == "unrolled":  # TorchDEQ deq-lm's recipe: backprop through the fixed-point iterations
        deq.update(f_solver="fixed_point", b_mode="unrolled")
    return DEQTransformerConfig(**common, d_inner=args.d_inner, variant=args.variant,
                                pre_lnorm=args.pre_lnorm,
                                jac_reg_weight=args.jac_reg, deq=deq)


def batches(ids: torch.Tensor, batch: int, seg: int):
    """Endless (x, y, new_epoch) over `batch` parallel streams, consecutive segments (memory carries over)."""
    n = (ids.numel() - 1) // batch
    xs = ids[: n * batch].view(batch, n)
    ys = ids[1: n * batch + 1].view(batch, n)
    while True:
        for i, s in enumerate(range(0, n - seg + 1, seg)):
            yield xs[:, s:s + seg], ys[:, s:s + seg], i == 0


def save_state(state_dir: Path, model, opt, sched, step: int, log: list, tokenizer) -> None:
    """Resumable training state: tensors in safetensors (model, Adam moments, CPU RNG), the rest in JSON;
    written to temporary names first so a crash mid-save leaves the previous state complete."""
    from safetensors.torch import save_file

    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"opt.{index[id(p)]}.{k}"] = v.detach().reshape(-1) if k == "step" else v.detach()
    tensors["rng"] = torch.get_rng_state()
    tmp = state_dir / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    # the optimizer's current learning rates too: the scheduler sets them only at its next step
    (state_dir / "state.json.tmp").write_text(json.dumps({"step": step, "sched": sched.state_dict(),
                                                          "lrs": [g["lr"] for g in opt.param_groups],
                                                          "log": log}))
    tmp.replace(state_dir / "state.safetensors")
    (state_dir / "state.json.tmp").replace(state_dir / "state.json")
    if not (state_dir / "tokenizer.json").is_file():
        tokenizer.save_pretrained(state_dir)


def load_state(state_dir: Path, model, opt, sched) -> tuple[int, list]:
    """Restore what `save_state` wrote; returns (next step, log so far)."""
    from safetensors.torch import load_file

    tensors = load_file(str(state_dir / "state.safetensors"))
    meta = json.loads((state_dir / "state.json").read_text())
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    for i, p in enumerate(model.parameters()):
        st = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = st
    sched.load_state_dict(meta["sched"])
    for group, lr in zip(opt.param_groups, meta["lrs"], strict=True):
        group["lr"] = lr
    torch.set_rng_state(tensors["rng"])
    return meta["step"] + 1, meta["log"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--explicit", action="store_true", help="train the explicit (untied) baseline")
    p.add_argument("--explicit-d-inner", type=int, default=96)
    p.add_argument("--explicit-layers", type=int, default=2)
    p.add_argument("--corpus", choices=("pydoc", "pydoc+stdlib"), default="pydoc")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-inner", type=int, default=512)
    p.add_argument("--state-dir", default=None, help="save a resumable training state here")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from --state-dir's state")
    p.add_argument("--jac-reg", type=float, default=0.0, help="Jacobian regularization weight (0 = off)")
    p.add_argument("--b-mode", choices=("ift", "phantom", "unrolled", "jacobian_free"), default="ift",
                   help="backward mode")
    p.add_argument("--variant", choices=("bai2019", "torchdeq"), default="bai2019")
    p.add_argument("--pre-lnorm", action="store_true", help="bai2019 with LayerNorm before each sublayer")
    p.add_argument("--phantom-k", type=int, default=5)
    p.add_argument("--phantom-tau", type=float, default=0.6)
    p.add_argument("--train-f-iter", type=int, default=14, help="forward solver iterations in training")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seg", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log", default=None, help="write the per-step log (JSON) here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    state_dir = Path(args.state_dir) if args.state_dir else None
    if args.resume and not (state_dir and (state_dir / "state.json").is_file()):
        raise SystemExit(f"--resume: no state.json in --state-dir {args.state_dir!r}")
    if args.resume:  # the tokenizer the run started with
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(state_dir)
    else:
        tokenizer = train_tokenizer(args.vocab, args.corpus)
    config = build_config(args, tokenizer)
    model = DEQTransformerForCausalLM(config)
    n_params = sum(t.numel() for t in model.parameters())
    ids = (pystd_lm if args.corpus == "pydoc+stdlib" else pydoc_lm).token_stream(tokenizer, "train")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup = max(1, args.steps // 20)
    def lr_factor(s: int) -> float:  # linear warmup, cosine decay
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    cache, start, log, first = None, time.time(), [], 0
    data = batches(ids, args.batch, args.seg)
    if args.resume:
        first, log = load_state(state_dir, model, opt, sched)
        for _ in range(first):  # the data position of step `first` (the batches are a pure function of step)
            next(data)
        cache = None
    elapsed0 = sum(r.get("seconds", 0.0) for r in log[-1:])  # the run's own clock, carried over resumes
    bar = tqdm(range(first, args.steps), desc="train " + ("explicit" if args.explicit else "deq"),
               initial=first, total=args.steps)
    for step in bar:
        x, y, new_epoch = next(data)
        out = model(x, past_key_values=None if new_epoch else cache)
        cache = out.past_key_values
        cache.z_last = None
        nll = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        loss = nll
        if out.jac_loss is not None and args.jac_reg > 0:
            loss = loss + args.jac_reg * out.jac_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        sched.step()
        log.append({"step": step, "nll": float(nll), "nfe": int(out.deq_stats.nfe),
                    "jac": float(out.jac_loss) if out.jac_loss is not None else None,
                    "seconds": round(elapsed0 + time.time() - start, 2)})
        bar.set_postfix(nll=f"{float(nll):.3f}", nfe=int(out.deq_stats.nfe))
        if state_dir and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            save_state(state_dir, model, opt, sched, step, log, tokenizer)

    if args.b_mode == "unrolled":  # evaluate with the iterations it was trained for
        model.set_deq(f_solver="fixed_point", f_max_iter=args.train_f_iter, f_tol=1e-3, jac_reg_samples=0)
    else:
        model.set_deq(**EVAL_DEQ, jac_reg_samples=0)
    model.eval()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"args": vars(args), "params": n_params, "train_tokens": args.steps * args.batch * args.seg,
            "train_seconds": round(log[-1]["seconds"] if log else 0.0, 1),
            "final_nll": sum(r["nll"] for r in log[-20:]) / max(1, len(log[-20:]))}
    if args.log:
        Path(args.log).write_text(json.dumps({"meta": meta, "log": log}))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
