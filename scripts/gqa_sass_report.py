"""Registers, spills, occupancy and SASS instructions per KV block of the GQA-aware kernel, commit
by commit: what each change of issue 17 did, measured without a GPU.

    python scripts/gqa_sass_report.py                    # the table, printed
    python scripts/gqa_sass_report.py --out benchmarks/results/gqa_sass_report.md

For each commit of REVISIONS it extracts ``mini_vllm/csrc`` at that commit (``git archive``),
compiles ``paged_attention_gqa.cu`` with nvcc for each architecture (one instantiation: fp16,
head size 128, block size 16, the benchmark's default shape; ``-lineinfo``), and reads

* ptxas's report: registers per thread, spill stores/loads, static shared memory, per kernel;
* the SASS (``nvdisasm -g``): each loop over KV blocks is found by its backward branch, whose
  source line is the loop's ``for``; its body's instructions are counted per KV block (a loop
  iteration covers one block, or a 32-token tile of several; the scalar value loop runs on all 4
  warps for every block), with the instruction mix (FFMA, HMMA, loads);
* occupancy: thread blocks per SM from registers, threads and shared memory against the
  architecture's limits (the CUDA occupancy calculator's rules: registers allocated per warp in
  units of 256, shared memory in units of 128 bytes plus 1 KB reserved per block on sm_80+);
* waves: the grid of three decode shapes (64 query / 8 KV heads) on the architecture's reference
  GPU (T4: 40 SMs, A100: 108, H100: 132) divided by the resident blocks.

Needs nvcc and nvdisasm (CUDA 13: ``pip install nvidia-cuda-nvdisasm``; found on PATH or in the
nvidia wheels of this Python). No GPU: nothing here runs a kernel, so it says nothing about time.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# (label, commit, partition policy): the commits of issue 17's GQA changes, in order.
REVISIONS = [
    ("before (main)", "3ebb4b7", "512"),
    ("+ launch bound (4 blocks/SM)", "8586bc3", "512"),
    ("+ value loop without per-token test", "c7e9dbc", "512"),
    ("+ partition size from the shape", "f63c6ba", "adaptive"),
    ("+ tensor cores (wmma)", "baf706e", "adaptive"),
    ("+ tensor cores, tail out of the loop", "fba0a94", "adaptive"),
    ("+ scalar loops as functions (the lab's stretch)", "1fb29a3", "adaptive"),
]
ARCHS = {  # arch: (GPU, SMs, max threads/SM, max blocks/SM, shared memory/SM, reserved/block)
    "sm_90": ("H100 SXM", 132, 2048, 32, 228 * 1024, 1024),
    "sm_80": ("A100", 108, 2048, 32, 164 * 1024, 1024),
    "sm_75": ("T4", 40, 1024, 16, 64 * 1024, 0),
}
REGS_PER_SM = 65536
THREADS = 128
HEAD_SIZE, BLOCK_SIZE, ELEM = 128, 16, 2  # the instantiation measured (fp16)
SHAPES = [(8, 4096), (1, 4096), (8, 512)]  # (sequences, context); 64 query / 8 KV heads
NUM_HEADS, NUM_KV_HEADS = 64, 8


@dataclass
class Loop:
    line: int
    source: str
    kind: str  # "keys" or "values"
    instructions: int  # in one iteration
    per_kv_block: float  # warp-instructions per KV block
    mix: dict[str, int] = field(default_factory=dict)


@dataclass
class Kernel:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    loops: list[Loop] = field(default_factory=list)


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for base in (sysconfig.get_paths()["purelib"],):
        for path in Path(base).glob(f"nvidia/*/bin/{name}"):
            return str(path)
    raise SystemExit(f"{name} not found: install the CUDA toolkit or `pip install "
                     f"nvidia-cuda-{name}` (the nvidia wheel puts it next to this Python)")


def sources_at(commit: str, dest: Path) -> Path:
    data = subprocess.run(["git", "archive", commit, "mini_vllm/csrc"], cwd=REPO_ROOT,
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "mini_vllm" / "csrc"


def compile_cubin(csrc: Path, arch: str, out: Path, source: Path | None = None) -> str:
    """Compile `source` (default: the GQA kernel) for `arch` into the cubin `out`, one
    instantiation (fp16 model and cache, HEAD_SIZE, BLOCK_SIZE); returns ptxas's report."""
    source = source or csrc / "paged_attention_gqa.cu"
    cmd = [tool("nvcc"), "-std=c++17", f"-arch={arch}", "-cubin", "-lineinfo", "-Xptxas", "-v",
           "-DMINI_VLLM_DTYPES=1", "-DMINI_VLLM_KV_CACHE_DTYPES=0",  # the fp16 cache only
           f"-DMINI_VLLM_HEAD_SIZES={HEAD_SIZE}",
           f"-DMINI_VLLM_BLOCK_SIZES={BLOCK_SIZE}", f"-I{csrc}",
           str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source.name} on {arch}:\n{proc.stderr[-3000:]}")
    return proc.stderr


def parse_ptxas(report: str, keep=lambda name: "gqa" in name) -> dict[str, Kernel]:
    """{mangled kernel name: Kernel} from ptxas -v, for the kernels `keep` accepts."""
    kernels, name = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and name and keep(name):
            short = "tensor cores" if "gqa_tc_kernel" in name else "scalar"
            kernels[name] = Kernel(short, int(m.group(1)), *spills, int(m.group(2) or 0))
    return kernels


def parse_sass(sass: str, kernel: str) -> list[tuple[int, str, str, int]]:
    """(address, instruction, file, line) of one kernel's SASS."""
    start = sass.index(f".text.{kernel}:")
    end = sass.find("//--------------------- .text.", start)
    body = sass[start: end if end > 0 else len(sass)]
    file, line, out, labels = "", 0, [], {}
    for raw in body.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', raw)
        if m:
            file, line = Path(m.group(1)).name, int(m.group(2))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", raw)
        if m:
            labels[m.group(1)] = len(out)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", raw)
        if m:
            out.append((int(m.group(1), 16), m.group(2), file, line))
    return out, labels


MIX = {"FFMA": r"\bFFMA\b", "HMMA": r"\bHMMA\b", "LDG": r"\bLDG\b", "LDS/LDSM": r"\bLDS(M)?\b",
       "STS": r"\bSTS\b", "SHFL": r"\bSHFL\b", "other": None}


def kv_loops(instrs, labels, source: list[str]) -> list[Loop]:
    """The loops over KV blocks: backward branches whose source line is a `for (int block` or
    `for (int tile` header of paged_attention_gqa.cu."""
    loops = []
    for i, (_, ins, file, line) in enumerate(instrs):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if not m or labels.get(m.group(1), i + 1) > i or file != "paged_attention_gqa.cu":
            continue
        text = source[line - 1].strip() if 0 < line <= len(source) else ""
        if not re.match(r"for \(int (block|tile) = ", text):
            continue
        body = instrs[labels[m.group(1)]: i + 1]
        if "tile" in text:  # a 32-token tile per iteration, one warp
            blocks, warps = 32 // BLOCK_SIZE, 1
        else:
            blocks, warps = 1, (1 if "NUM_WARPS" in text else THREADS // 32)
        kind = "keys" if not any(lp.kind == "keys" for lp in loops) else "values"
        mix = {}
        for name, pattern in MIX.items():
            if pattern:
                mix[name] = sum(bool(re.search(pattern, b[1])) for b in body)
        mix["other"] = len(body) - sum(mix.values())
        loops.append(Loop(line, text, kind, len(body), len(body) * warps / blocks, mix))
    return loops


def tc_dynamic_smem(partition: int) -> int:
    """TcLayout<__half, 128>::bytes(P) of paged_attention_gqa.cu, mirrored."""
    def up(b):
        return -(-b // 128) * 128
    q_ld, dp = HEAD_SIZE + 8, -(-HEAD_SIZE // 32) * 32
    stage = max(32 * (64 + 8), 32 * (32 + 8))
    return (up(8 * q_ld * ELEM) + up(8 * (partition + 8) * ELEM) + up(2 * 8 * 4 * 4)
            + up(4 * max(8 * (partition + 4), 4 * 8 * dp)) + up(4 * stage * ELEM))


def occupancy(arch: str, registers: int, smem: int, threads: int = THREADS) -> tuple[int, str]:
    """Resident thread blocks per SM and what limits them."""
    _, _, max_threads, max_blocks, smem_sm, reserved = ARCHS[arch]
    warps = threads // 32
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = (REGS_PER_SM // regs_per_warp) // warps
    by_threads = max_threads // threads
    per_block = math.ceil(smem / 128) * 128 + reserved if smem else reserved
    by_smem = smem_sm // per_block if per_block else max_blocks
    limits = {"registers": by_regs, "threads": by_threads, "shared memory": by_smem,
              "blocks": max_blocks}
    blocks = min(limits.values())
    return blocks, min(limits, key=limits.get)


def partition_for(policy: str, num_seqs: int, context: int, sms: int, resident: int) -> int:
    if policy == "512":
        return 512
    sys.path.insert(0, str(REPO_ROOT))
    from mini_vllm.csrc.ops import gqa_partition_size

    return gqa_partition_size(num_seqs, NUM_HEADS, NUM_KV_HEADS, context, sms, resident)


def measure(label: str, commit: str, policy: str, arch: str, tmp: Path) -> list[dict]:
    work = tmp / f"{commit}-{arch}"
    csrc = sources_at(commit, work)
    cubin = work / "gqa.cubin"
    kernels = parse_ptxas(compile_cubin(csrc, arch, cubin))
    sass = subprocess.run([tool("nvdisasm"), "-g", "-c", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    source = (csrc / "paged_attention_gqa.cu").read_text(encoding="utf-8").splitlines()
    gpu, sms = ARCHS[arch][0], ARCHS[arch][1]
    rows = []
    for mangled, k in kernels.items():
        instrs, labels = parse_sass(sass, mangled)
        k.loops = kv_loops(instrs, labels, source)
        waves = {}
        for num_seqs, context in SHAPES:
            smem = k.static_smem
            if k.name == "tensor cores":
                resident0, _ = occupancy(arch, k.registers, tc_dynamic_smem(512))
                part = partition_for(policy, num_seqs, context, sms, resident0)
                smem += tc_dynamic_smem(part)
            else:
                resident0, _ = occupancy(arch, k.registers, smem)
                part = partition_for(policy, num_seqs, context, sms, resident0)
            resident, _ = occupancy(arch, k.registers, smem)
            grid = NUM_KV_HEADS * num_seqs * -(-context // part)
            waves[f"{num_seqs}x{context}"] = {"partition": part, "blocks": grid,
                                              "waves": round(grid / (resident * sms), 2)}
        smem512 = k.static_smem + (tc_dynamic_smem(512) if k.name == "tensor cores" else 0)
        resident, limiter = occupancy(arch, k.registers, smem512)
        rows.append({
            "label": label, "commit": commit, "arch": arch, "gpu": gpu, "kernel": k.name,
            "registers": k.registers, "spill_stores": k.spill_stores,
            "spill_loads": k.spill_loads, "smem_bytes_at_512": smem512,
            "blocks_per_sm": resident, "limited_by": limiter,
            "occupancy_pct": round(100 * resident * THREADS / ARCHS[arch][2], 1),
            "instr_per_kv_block": round(sum(lp.per_kv_block for lp in k.loops), 1),
            "loops": [asdict(lp) for lp in k.loops], "waves": waves,
        })
    return rows


# ------------------------------------------------------------------------------------------
# Any attention source (lab 02-06's `course measure` without a GPU): one kernel per row
# ------------------------------------------------------------------------------------------

ARCH_NAMES = {"T4": "sm_75", "A100": "sm_80", "H100": "sm_90"}


def kernel_base_name(mangled: str) -> str:
    """`paged_attention_v1_kernel` from `_ZN9mini_vllm25paged_attention_v1_kernelI...`."""
    m = re.match(r"_ZN\d+\w*?(?=\d)", mangled)
    rest = mangled[m.end():] if m else mangled
    n = re.match(r"(\d+)", rest)
    return rest[len(n.group(1)): len(n.group(1)) + int(n.group(1))] if n else mangled


def load_bits(instruction: str) -> int | None:
    """Width in bits of a global load (LDG.E.128 -> 128, LDG.E.U16 -> 16, LDG.E -> 32)."""
    if not re.match(r"LDG\b", instruction.split()[0] if instruction.split() else ""):
        return None
    mods = instruction.split()[0].split(".")[1:]
    for mod, bits in (("128", 128), ("64", 64), ("U16", 16), ("S16", 16), ("U8", 8), ("S8", 8)):
        if mod in mods:
            return bits
    return 32


def loops_of(instrs, labels, sources: dict[str, list[str]]) -> list[dict]:
    """Every loop of one kernel (a backward branch): its source line, the instructions and global
    loads of one pass through its body, and, for a loop over the KV cache, warp-instructions per
    KV block of BLOCK_SIZE tokens (read from its header: a warp per block, the 128 threads over
    tokens, or every thread over blocks; None for loops over something else)."""
    out = []
    for i, (_, ins, file, line) in enumerate(instrs):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if not m or labels.get(m.group(1), i + 1) >= i or file not in sources:
            continue  # not a loop, a branch to itself (the trap after EXIT), or a header's
        lines = sources.get(file, [])
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        body = instrs[labels[m.group(1)]: i + 1]
        widths: dict[int, int] = {}
        for b in body:
            bits = load_bits(b[1])
            if bits:
                widths[bits] = widths.get(bits, 0) + 1
        if re.search(r"\+= NUM_WARPS", text):  # one warp per KV block
            per_block = float(len(body))
        elif re.search(r"\+= BLOCK_SIZE", text):  # every thread walks the blocks
            per_block = float(len(body) * THREADS // 32)
        elif re.search(r"threadIdx\.x;.*(seq_len|num_tokens).*\+= NUM_THREADS", text):
            per_block = len(body) * BLOCK_SIZE / 32  # a thread per token: 32 tokens per warp
        else:
            per_block = None
        out.append({"where": f"{file}:{line}", "source": text, "instructions": len(body),
                    "loads": widths, "per_kv_block": per_block})
    # nvcc unrolls a loop into a main body (several iterations) and a remainder (one); both
    # branch back to the same source line, and the smallest body is one iteration.
    single: dict[str, dict] = {}
    for lp in out:
        if lp["where"] not in single or lp["instructions"] < single[lp["where"]]["instructions"]:
            single[lp["where"]] = lp
    return list(single.values())


def report_source(source: Path, arch: str, csrc: Path, tmp: Path,
                  skip=lambda name: "probe" in name) -> list[dict]:
    """One row per kernel that `source` compiles to (for `arch`): registers, spills, static
    shared memory, the global loads by width, and the loops. Raises RuntimeError with nvcc's
    message when the source does not compile."""
    cubin = tmp / f"{source.stem}-{arch}.cubin"
    kernels = parse_ptxas(compile_cubin(csrc, arch, cubin, source),
                          keep=lambda name: not skip(name))
    sass = subprocess.run([tool("nvdisasm"), "-g", "-c", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    sources = {p.name: p.read_text(encoding="utf-8").splitlines()
               for p in [source, *csrc.glob("*.cuh")]}
    rows = []
    for mangled, k in kernels.items():
        instrs, labels = parse_sass(sass, mangled)
        widths: dict[int, int] = {}
        for ins in instrs:
            bits = load_bits(ins[1])
            if bits:
                widths[bits] = widths.get(bits, 0) + 1
        loops = loops_of(instrs, labels, sources)
        per_block = [lp["per_kv_block"] for lp in loops if lp["per_kv_block"] is not None]
        rows.append({"kernel": kernel_base_name(mangled), "registers": k.registers,
                     "spill_stores": k.spill_stores, "spill_loads": k.spill_loads,
                     "static_smem": k.static_smem, "instructions": len(instrs),
                     "loads": widths, "loops": loops,
                     "per_kv_block": round(sum(per_block), 1) if per_block else None})
    return rows


def dynamic_smem(kernel: str, context: int, partition: int = 512) -> int:
    """Dynamic shared memory of lab 02-06's kernels at one sequence of `context` tokens (head
    128, 4 warps): the logits, at least one float per warp per head element (the reduce's
    scratch); the reduce kernel holds one float per partition."""
    floor = 4 * (THREADS // 32) * HEAD_SIZE
    if "reduce" in kernel:
        return 4 * -(-context // partition)
    if "v2" in kernel:
        return max(4 * partition, floor)
    if "naive" in kernel:
        return 4 * context
    return max(4 * -(-context // BLOCK_SIZE) * BLOCK_SIZE, floor)


def table(rows: list[dict]) -> str:
    head = ("| change | commit | arch | kernel | regs | spills (st/ld B) | smem @512 | blocks/SM "
            "(limit) | occupancy | SASS/KV block: keys + values = total | FFMA | HMMA | "
            "waves 8x4096 / 1x4096 / 8x512 (partition) |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        keys = sum(lp["per_kv_block"] for lp in r["loops"] if lp["kind"] == "keys")
        vals = sum(lp["per_kv_block"] for lp in r["loops"] if lp["kind"] == "values")
        ffma = sum(lp["mix"]["FFMA"] * lp["per_kv_block"] / max(lp["instructions"], 1)
                   for lp in r["loops"])
        hmma = sum(lp["mix"]["HMMA"] * lp["per_kv_block"] / max(lp["instructions"], 1)
                   for lp in r["loops"])
        waves = " / ".join(f"{w['waves']} ({w['partition']})" for w in r["waves"].values())
        lines.append(
            f"| {r['label']} | {r['commit']} | {r['arch']} | {r['kernel']} | {r['registers']} | "
            f"{r['spill_stores']}/{r['spill_loads']} | {r['smem_bytes_at_512']} | "
            f"{r['blocks_per_sm']} ({r['limited_by']}) | {r['occupancy_pct']}% | "
            f"{keys:.0f} + {vals:.0f} = {keys + vals:.0f} | {ffma:.0f} | {hmma:.0f} | {waves} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--out", type=Path, help="write the table (markdown) here and the rows as "
                   "JSON next to it (.json)")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gqa-sass-") as tmp:
        jobs = [(label, commit, policy, arch) for label, commit, policy in REVISIONS
                for arch in args.archs]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda j: measure(*j, Path(tmp)), jobs))
    rows = [r for rs in results for r in rs]
    order = {a: i for i, a in enumerate(ARCHS)}
    rows.sort(key=lambda r: (order[r["arch"]], [x[1] for x in REVISIONS].index(r["commit"])))
    nvcc = subprocess.run([tool("nvcc"), "--version"], capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/gqa_sass_report.py",
                                                            *(argv or sys.argv[1:])])
    text = (f"# GQA-aware kernel: registers, spills, occupancy, SASS per KV block\n\n"
            f"Made by `{command}` ({nvcc}; no GPU: nothing was timed).\n"
            f"Instantiation: fp16, head size {HEAD_SIZE}, block size {BLOCK_SIZE}, 128 threads. "
            f"Waves: grid / (blocks per SM x SMs) for {NUM_HEADS} query / {NUM_KV_HEADS} KV "
            f"heads on the arch's GPU; SASS counts are warp-instructions per KV block of "
            f"{BLOCK_SIZE} tokens, summed over the warps that handle it.\n\n" + table(rows) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
        args.out.with_suffix(".json").write_text(
            json.dumps({"command": command, "nvcc": nvcc, "rows": rows}, indent=1) + "\n",
            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
