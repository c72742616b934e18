"""Train the independent evaluation classifier for the DDIM digits model on held-out real digits only.

    PYTHONPATH=$PWD python examples/deq_ddim/train_classifier.py --out model_cards/ddim-digits-16/evaluator

Data: `ddim_digits.load_split("classifier_train")` (397 held-out images the diffusion model never
saw), random +-1 pixel shifts; reports accuracy on `classifier_test` (200 images). Writes `config.json`
(`{"width": ...}`) and `model.safetensors`. Seeded; about a minute on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_ddim.ddim_digits import DigitClassifier, load_split


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x, y = load_split("classifier_train")
    xt, yt = load_split("classifier_test")
    model = DigitClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-3)
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 32):
            idx = perm[i : i + 32]
            xb = x[idx]
            dx, dy = torch.randint(-1, 2, (2,)).tolist()  # shift augmentation (pad with background -1)
            xb = torch.roll(torch.nn.functional.pad(xb, (1, 1, 1, 1), value=-1.0), (dy, dx), (2, 3))[
                ..., 1:-1, 1:-1
            ]
            loss = torch.nn.functional.cross_entropy(model(xb), y[idx], label_smoothing=0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if (epoch + 1) % 10 == 0:
            model.eval()
            with torch.no_grad():
                acc = (model(xt).argmax(1) == yt).float().mean().item()
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}, held-out accuracy {acc:.4f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(
        json.dumps({"width": model.width, "test_accuracy": round(acc, 4)}) + "\n"
    )


if __name__ == "__main__":
    main()
