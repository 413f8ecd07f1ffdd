#!/usr/bin/env python3
"""lorastep's one tool for building, checking and benchmarking, on a GPU machine or on CPU.

    python3 scripts/bench.py build  [--build-dir D] [--target T ...]
    python3 scripts/bench.py check  [--dtype float32 --dtype bfloat16] [--tests REGEX] [--device cuda|cpu]
    python3 scripts/bench.py suite  NAME [NAME ...] [--out DIR] [suite options]
    python3 scripts/bench.py all    [--suite NAME ...]      (build, check, then the suites)
    python3 scripts/bench.py verify NAME [NAME ...] --out DIR  (only check a suite's outputs)
    python3 scripts/bench.py list                            (the suites and what each writes)

Every step's failure is remembered and the tool exits non-zero at the end: a failed build, a
failed test (ctest's own exit status), a parity check over its tolerance ("pass": false in its
result), a benchmark command that failed, or a result file a suite should have written and
did not. Models are generated fresh into a temporary folder keyed by preset, dtype and seed
(MODELS_DIR/PRESET-DTYPE-sSEED), and regenerated when the generator binary changed.

The GPU build links against the Python environment's torch and the carried Debian sysroot
(.sysroot: absl, gRPC, protobuf, gtest, OpenSSL; scripts/make_sysroot.sh) with CMake and Ninja.
"""
import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Failures:
    """What went wrong, in order; the exit status is non-zero when there is anything."""

    def __init__(self):
        self.items = []

    def add(self, what):
        print(f"FAILED: {what}", flush=True)
        self.items.append(what)

    def exit_code(self):
        if self.items:
            print(f"\n{len(self.items)} failure(s):", *[f"  - {w}" for w in self.items], sep="\n", flush=True)
            return 1
        print("\nall steps passed", flush=True)
        return 0


def banner(text):
    print(f"=== {text}", flush=True)


def run(cmd, fails, what, env=None, log=None, cwd=REPO):
    """Runs cmd (a list, or a string for bash); a non-zero exit is a failure named `what`."""
    shell = isinstance(cmd, str)
    full_env = dict(os.environ, **(env or {}))
    out = open(log, "w") if log else None
    try:
        rc = subprocess.call(["bash", "-c", cmd] if shell else cmd, env=full_env, cwd=cwd,
                             stdout=out or None, stderr=subprocess.STDOUT if out else None)
    except OSError as e:
        rc = 127
        print(e, flush=True)
    finally:
        if out:
            out.close()
    if rc != 0:
        tail = ""
        if log and os.path.exists(log):
            tail = "\n" + "".join(open(log, errors="replace").readlines()[-25:])
        fails.add(f"{what} (exit {rc}){tail}")
    return rc == 0


@functools.lru_cache(maxsize=None)
def nccl_dir():
    """The nvidia-nccl Python package's folder (GPU machine), or None."""
    out = subprocess.run([sys.executable, "-c", "import nvidia.nccl as n;print(list(n.__path__)[0])"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def python_torch_paths():
    code = "import torch,os;print(os.path.dirname(torch.__file__));print(torch.utils.cmake_prefix_path)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return None, None
    lines = out.stdout.split()
    return lines[0], lines[1]


class Context:
    def __init__(self, args, fails):
        self.args = args
        self.fails = fails
        self.build = os.path.abspath(args.build_dir)
        self.out = os.path.abspath(args.out)
        self.models = os.path.abspath(args.models_dir)
        os.makedirs(self.out, exist_ok=True)
        self.env = self._environment()

    def _environment(self):
        """Library paths for the sysroot, torch and NCCL (GPU machine); harmless elsewhere."""
        env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        sysroot = os.path.abspath(self.args.sysroot)
        libs = [f"{sysroot}/usr/lib/x86_64-linux-gnu", f"{sysroot}/lib/x86_64-linux-gnu"]
        torch_dir, _ = python_torch_paths()
        if torch_dir:
            libs.append(f"{torch_dir}/lib")
        if nccl_dir():
            libs.append(nccl_dir() + "/lib")
        env["LD_LIBRARY_PATH"] = ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])
        env["LIBRARY_PATH"] = ":".join(libs[:2])
        env["PATH"] = f"{sysroot}/usr/bin:" + os.environ.get("PATH", "")
        return env

    def machine_line(self):
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        return f"{os.uname().nodename} (CPU, {os.cpu_count()} cores)"

    def versions_line(self):
        code = ("import importlib\nparts=[]\nfor m in ('torch','transformers','peft'):\n"
                "  try:\n    parts.append(m+' '+importlib.import_module(m).__version__)\n"
                "  except Exception: pass\n"
                "try:\n  import torch; parts.insert(1,'cuda '+str(torch.version.cuda))\nexcept Exception: pass\n"
                "print(' '.join(parts))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return out.stdout.strip() or "no torch in this Python"

    def commit(self):
        """--commit, else the checkout's HEAD (with "+changes" when the tree differs from it)."""
        if self.args.commit:
            return self.args.commit
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return "unknown (no git checkout; pass --commit)"
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")

    def write_env(self):
        """OUT/env.txt: the machine (first line), the commit, and library versions (last line)."""
        path = os.path.join(self.out, "env.txt")
        with open(path, "w") as f:
            f.write(f"machine: {self.machine_line()}\ncommit: {self.commit()}\n{self.versions_line()}\n")
        print(open(path).read(), end="", flush=True)

    def binary(self, name):
        return os.path.join(self.build, name)

    def model(self, preset, dtype="bfloat16", seed=1):
        """A model folder generated by lorastep_genmodel, keyed by preset, dtype and seed; made again
        when the generator changed since (its size and mtime are the stamp)."""
        gen = self.binary("lorastep_genmodel")
        folder = os.path.join(self.models, f"{preset}-{dtype}-s{seed}")
        st = os.stat(gen) if os.path.exists(gen) else None
        stamp = json.dumps({"preset": preset, "dtype": dtype, "seed": seed,
                            "generator": [st.st_size, int(st.st_mtime)] if st else None})
        stamp_file = os.path.join(folder, ".lorastep_model_stamp")
        if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(self.models, exist_ok=True)
        if not run([gen, "--preset", preset, "--dtype", dtype, "--seed", str(seed), "--out", folder], self.fails,
                   f"generate model {preset} {dtype} seed {seed}", env=self.env, log=folder + ".log"):
            return folder
        with open(stamp_file, "w") as f:
            f.write(stamp)
        return folder

    def command_line(self):
        return "python3 scripts/bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])


# ---------------------------------------------------------------- build and check


def cmd_build(ctx):
    banner("configure and build (CMake + Ninja)")
    _, torch_cmake = python_torch_paths()
    sysroot = os.path.abspath(ctx.args.sysroot)
    prefix = ";".join(p for p in [torch_cmake, f"{sysroot}/usr"] if p)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else "")
    configure = ["cmake", "-S", REPO, "-B", ctx.build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={prefix}"]
    if os.path.isdir(sysroot):
        configure += [f"-DOPENSSL_ROOT_DIR={sysroot}/usr", f"-DProtobuf_ROOT={sysroot}/usr"]
    if nvcc:
        configure += ["-DCMAKE_CUDA_ARCHITECTURES=" + ctx.args.cuda_arch, f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    if nccl_dir():
        configure += ["-DLORASTEP_WITH_NCCL=ON", f"-DLORASTEP_NCCL_INCLUDE={nccl_dir()}/include"]
    arch = ctx.args.cuda_arch
    env = dict(ctx.env, TORCH_CUDA_ARCH_LIST=f"{arch[:-1]}.{arch[-1]}" if nvcc else "")
    if not run(configure, ctx.fails, "cmake configure", env=env, log=os.path.join(ctx.out, "cmake.log")):
        return False
    print(f"CUDA kernels: {'on (' + nvcc + ')' if nvcc else 'off (no nvcc)'}", flush=True)
    build = ["ninja", "-C", ctx.build, f"-j{os.cpu_count()}"] + list(ctx.args.target or [])
    return run(build, ctx.fails, "build", env=env, log=os.path.join(ctx.out, "build.log"))


def cmd_check(ctx):
    """ctest per dtype; ctest's exit status decides (a red test is a failure of the tool)."""
    device = ctx.args.device
    for dtype in ctx.args.dtype or ["float32", "bfloat16"]:
        banner(f"tests on {device}, {dtype}")
        log = os.path.join(ctx.out, f"ctest_{device}_{dtype}.log")
        cmd = ["ctest", "--output-on-failure", "--verbose"]  # every test's output: its skips too
        if ctx.args.tests:
            cmd += ["-R", ctx.args.tests]
        gpus = subprocess.run(["bash", "-c", "nvidia-smi -L 2>/dev/null | wc -l"], capture_output=True, text=True)
        env = dict(ctx.env, LORASTEP_TEST_DEVICE=device, LORASTEP_TEST_DTYPE=dtype,
                   LORASTEP_TEST_GPUS=gpus.stdout.strip() or "0")
        ok = run(cmd, ctx.fails, f"tests on {device} {dtype}", env=env, log=log, cwd=ctx.build)
        text = open(log, errors="replace").read()
        summary = [l.rstrip() for l in text.splitlines() if "tests passed" in l or "Failed" in l or "***" in l]
        print("\n".join(summary[-12:]) or ("passed" if ok else "no summary"), flush=True)
        # A test that skips (its kernel or device is absent here) passes: name them, so a GPU
        # run shows what it did not check.
        skipped = sorted(set(re.findall(r"\[  SKIPPED \] (\S+) \(\d+ ms\)", text)))
        print(f"skipped on {device} {dtype}: {len(skipped)}" + "".join(f"\n  {t}" for t in skipped), flush=True)


# ---------------------------------------------------------------- suites


def require(ctx, names):
    """Result files a suite must have written into OUT."""
    for name in names:
        if not os.path.exists(os.path.join(ctx.out, name)):
            ctx.fails.add(f"missing result {name}")


def require_pass(ctx, name, key="pass"):
    """A parity result whose `pass` is not true (over its tolerance) is a failure."""
    path = os.path.join(ctx.out, name)
    if not os.path.exists(path):
        ctx.fails.add(f"missing result {name}")
        return
    try:
        data = json.load(open(path))
    except ValueError as e:
        ctx.fails.add(f"{name}: not JSON ({e})")
        return
    entries = data.get("families", {"": data}) if isinstance(data, dict) else {}
    for label, entry in entries.items():
        if not isinstance(entry, dict) or entry.get(key) is not True:
            ctx.fails.add(f"{name}{' ' + label if label else ''}: {key} is {entry.get(key) if isinstance(entry, dict) else entry!r}")


def bench_env(ctx):
    """What the bench/*.sh scripts read: the machine and versions lines."""
    lines = open(os.path.join(ctx.out, "env.txt")).read().splitlines()
    commit = next((l.removeprefix("commit: ") for l in lines if l.startswith("commit: ")), ctx.commit())
    return dict(ctx.env, MACHINE=lines[0].removeprefix("machine: "), VERSIONS=lines[-1],
                BENCH_COMMAND=ctx.command_line(), BENCH_COMMIT=commit)


def parity_run(ctx, model, dtype, out_name, extra=(), grep=None):
    tol = "1e-3" if dtype == "float32" else "3e-2"
    cmd = [sys.executable, "bench/hf_parity.py", "--model", model, "--parity-bin", ctx.binary("lorastep_parity"),
           "--device", "cuda", "--dtype", dtype, "--tolerance", tol,
           "--workdir", tempfile.mkdtemp(prefix="lorastep_parity_"), "--out", os.path.join(ctx.out, out_name)]
    run(cmd + list(extra), ctx.fails, f"parity {out_name}", env=dict(ctx.env, PYTHONUNBUFFERED="1"),
        log=os.path.join(ctx.out, out_name.replace(".json", ".log")))


def suite_dgrad(ctx):
    run([ctx.binary("dgrad_bench"), "--device", "cuda", "--out", os.path.join(ctx.out, "dgrad.json"),
         "--machine", ctx.machine_line(), "--command", ctx.command_line()], ctx.fails, "dgrad_bench", env=ctx.env)


def suite_parity(ctx):
    model = ctx.model("qwen2.5-0.5b", "bfloat16", 1)
    for dtype in ctx.args.dtype or ["float32", "bfloat16"]:
        parity_run(ctx, model, dtype, f"hf_parity_{dtype}.json")


def suite_parity_head(ctx):
    model = ctx.model("qwen2.5-0.5b", "bfloat16", 1)
    for dtype in ctx.args.dtype or ["float32", "bfloat16"]:
        parity_run(ctx, model, dtype, f"hf_parity_head_{dtype}.json",
                   ["--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"])


def suite_moe_parity(ctx):
    for preset in ("tiny-moe", "tiny-qwen3-moe"):
        model = ctx.model(preset, "float32", 2)
        for dtype in ctx.args.dtype or ["float32", "bfloat16"]:
            parity_run(ctx, model, dtype, f"moe_parity_{preset}_{dtype}.json",
                       ["--targets", "q_proj,k_proj,v_proj,o_proj", "--seq", "64"])


def suite_families(ctx):
    cmd = [sys.executable, "bench/families.py", "--parity-bin", ctx.binary("lorastep_parity"),
           "--out", os.path.join(ctx.out, "families.json")]
    if ctx.args.families_only:
        cmd += ["--only", ctx.args.families_only]
    run(cmd, ctx.fails, "families", env=dict(ctx.env, PYTHONUNBUFFERED="1"), log=os.path.join(ctx.out, "families.log"))


def suite_step(ctx):
    run(["bash", "bench/step_bench.sh", ctx.build, ctx.out], ctx.fails, "step benchmark", env=bench_env(ctx),
        log=os.path.join(ctx.out, "step.log"))


def suite_step7b(ctx):
    env = dict(bench_env(ctx), STEP7B_MBS=" ".join(ctx.args.step7b_mbs))
    if ctx.args.profile:
        env["STEP7B_PROFILE"] = "1"
    run(["bash", "bench/step7b.sh", ctx.build, ctx.out], ctx.fails, "7B step benchmark", env=env,
        log=os.path.join(ctx.out, "step7b.log"))


STEP_FAMILIES = {"gpt_oss": "gpt-oss-20b-reduced", "qwen3_5": "qwen3.5-9b"}


def suite_step_families(ctx):
    for prefix in ctx.args.step_families:
        run(["bash", "bench/step_family.sh", ctx.build, ctx.out, STEP_FAMILIES[prefix], prefix], ctx.fails,
            f"{prefix} step benchmark", env=bench_env(ctx), log=os.path.join(ctx.out, f"step_{prefix}.log"))


def suite_long(ctx):
    run(["bash", "bench/long_context.sh", ctx.build, ctx.out] + list(ctx.args.long_runs), ctx.fails,
        "long-context benchmark", env=bench_env(ctx), log=os.path.join(ctx.out, "long.log"))


def suite_attention(ctx):
    run([sys.executable, "bench/attention_backends.py", "--out", os.path.join(ctx.out, "attention_backends.json")],
        ctx.fails, "attention backends", env=ctx.env, log=os.path.join(ctx.out, "attention.log"))


# How each worker deployment starts: the worker inside the coordinator's process, or spawned
# (its per-step calls over the inherited call pipe, or, process_grpc, over gRPC).
# process_cold_poller: the default deployment without the gRPC poller kept warm after answers.
# process_sleeping: nor any caller polling for its answer near the expected time (the client,
# the pipe's waiting caller).
# process_random_targets: the default deployment sent a batch whose targets are random tokens
# of their own (sent whole) instead of the tokens shifted by one, as an RL rollout's are.
DEPLOYMENTS = {
    "process": {"IN_PROCESS_WORKER": "false", "COORD_FLAGS": ""},
    "process_grpc": {"IN_PROCESS_WORKER": "false", "COORD_FLAGS": "--noworker_pipe"},
    "process_cold_poller": {"IN_PROCESS_WORKER": "false", "COORD_FLAGS": "--grpc_poller_warm_us=0"},
    "process_sleeping": {"IN_PROCESS_WORKER": "false", "COORD_FLAGS": "--worker_pipe_poll=false --grpc_poller_warm_us=0",
                         "CLIENT_FLAGS": "--client_poll=false"},
    "process_random_targets": {"IN_PROCESS_WORKER": "false", "COORD_FLAGS": "", "CLIENT_FLAGS": "--targets random"},
    "in_process": {"IN_PROCESS_WORKER": "true", "COORD_FLAGS": ""},
}


def suite_service(ctx):
    model_env = dict(bench_env(ctx), MODEL_DIR=ctx.model("qwen2.5-0.5b", "bfloat16", 1), RANK="32",
                     STEPS=str(ctx.args.steps))
    # --service-log: each deployment once more with every call's duration logged on each side
    # (--v=2), to split the overhead; the logging's own cost stays out of the headline figures.
    # --service-tuned-client: once more with the benchmark client keeping large buffers in its
    # heap as the servers do (service_overhead --tune_malloc), to show its page faults' share.
    # --service-pin S/C: once more with the servers on CPUs S and the client on CPUs C (taskset),
    # after the unpinned passes, to show what threads moving between cores cost.
    pin = {}
    if ctx.args.service_pin:
        server_cpus, client_cpus = ctx.args.service_pin.split("/")
        pin = {"SERVER_CPUS": server_cpus, "CLIENT_CPUS": client_cpus}
    passes = ([("", "", "", {})] + ([("_pinned", "", "", pin)] if pin else [])
              + ([("_v2", "--v=2", "", {})] if ctx.args.service_log else [])
              + ([("_tuned_client", "", "--tune_malloc", {})] if ctx.args.service_tuned_client else []))
    for suffix, flags, client_flags, extra_env in passes:
        for deployment in ctx.args.deployment:
            d = DEPLOYMENTS[deployment]
            name = f"{deployment}{suffix}"
            env = dict(model_env, IN_PROCESS_WORKER=d["IN_PROCESS_WORKER"],
                       COORD_FLAGS=f"{d['COORD_FLAGS']} {flags}".strip(),
                       CLIENT_FLAGS=f"{d.get('CLIENT_FLAGS', '')} {client_flags}".strip(),
                       SERVER_LOG=os.path.join(ctx.out, f"service_{name}.server.log"), **extra_env)
            result = os.path.join(ctx.out, f"service_overhead_{name}.json")
            if run(["bash", "bench/service_overhead.sh", ctx.build, "qwen2.5-0.5b", "cuda", "bfloat16", result,
                    "overhead_fraction"], ctx.fails, f"service overhead ({name})", env=env,
                   log=os.path.join(ctx.out, f"service_{name}.log")) and flags:
                run([sys.executable, "bench/service_split.py", result, env["SERVER_LOG"],
                     os.path.join(ctx.out, f"service_split_{deployment}.json")], ctx.fails,
                    f"service split ({deployment})", env=ctx.env)


def suite_autosave(ctx):
    env = dict(bench_env(ctx), MODEL_DIR=ctx.model("qwen2.5-0.5b", "bfloat16", 1), RANK="32",
               COORD_FLAGS="--max_tokens_per_microbatch 8192")
    batch = os.path.join(ctx.out, "batch_fixed.json")
    run([sys.executable, "bench/make_batch.py", "--vocab", "151936", "--workload", "fixed", "--out", batch],
        ctx.fails, "batch", env=ctx.env)
    for kind in ctx.args.deployment:
        raw = os.path.join(ctx.out, f"autosave_{kind}")
        if run(["bash", "bench/autosave_cost.sh", ctx.build, "qwen2.5-0.5b", "cuda", "bfloat16", raw], ctx.fails,
               f"autosave ({kind})", env=dict(env, BATCH_FILE=batch, IN_PROCESS_WORKER=DEPLOYMENTS[kind]["IN_PROCESS_WORKER"],
                                              COORD_FLAGS=f"{env['COORD_FLAGS']} {DEPLOYMENTS[kind]['COORD_FLAGS']}".strip()),
               log=raw + ".log"):
            run([sys.executable, "bench/autosave_results.py", raw, raw + ".json", "--worker", kind, "--command",
                 ctx.command_line()], ctx.fails, f"autosave results ({kind})", env=ctx.env)


def suite_multi_gpu(ctx):
    env = dict(bench_env(ctx), MULTI_COMMAND=ctx.command_line())
    run(["bash", "bench/multi_gpu.sh", ctx.build, ctx.out], ctx.fails, "multi-GPU", env=env,
        log=os.path.join(ctx.out, "multi_gpu.log"))


def suite_attention_gqa(ctx):
    run([sys.executable, "bench/attention_bench.py", "--out", os.path.join(ctx.out, "attention.json")], ctx.fails,
        "attention: repeated K/V against grouped heads", env=ctx.env, log=os.path.join(ctx.out, "attention_gqa.log"))


def suite_gemm_rows(ctx):
    """The 7B shape's frozen GEMMs per row count, one GEMM against chunks (co-scheduled rows
    against a lone run's)."""
    run([sys.executable, "bench/gemm_rows.py", "--shape", "qwen2.5-7b", "--rows", "4096", "8192", "16384", "20480",
         "24576", "--chunks", "4096", "8192", "--out", os.path.join(ctx.out, "gemm_rows.json"),
         "--machine", ctx.machine_line(), "--versions", ctx.versions_line(), "--command", ctx.command_line()],
        ctx.fails, "GEMM shapes by rows", env=ctx.env, log=os.path.join(ctx.out, "gemm_rows.log"))


def suite_moe_bench(ctx):
    """Reduced Qwen3-30B-A3B (4 layers, 128 experts, top-8), bf16, 64 x 512: transformers' step
    beside lorastep's per expert-LoRA layout."""
    model = ctx.model("qwen3-30b-a3b-reduced", "bfloat16", 1)
    env = bench_env(ctx)
    run([sys.executable, "bench/peft_step.py", "--model", model, "--mode", "fwdbwd", "--out",
         os.path.join(ctx.out, "moe_hf_fwdbwd.json")], ctx.fails, "MoE: transformers", env=env,
        log=os.path.join(ctx.out, "moe_hf.log"))
    for layout in ctx.args.moe_layout:
        run(["bash", "bench/service_overhead.sh", ctx.build, "qwen3-30b-a3b-reduced", "cuda", "bfloat16",
             os.path.join(ctx.out, f"moe_ours_{layout}_4096.json"), f"moe_{layout}"], ctx.fails,
            f"MoE: lorastep {layout}",
            env=dict(env, MODEL_DIR=model, RANK="32", EXPERT_LORA=layout, MAX_TOKENS="4096", STEPS="3"),
            log=os.path.join(ctx.out, f"moe_ours_{layout}.log"))


def suite_digest(ctx):
    """The digest check of a TP2 rank's replicated LoRA gradients beside the LoRA step (run after
    the step suite in the same OUT: it reads ours_lora_fixed.json)."""
    model = ctx.model("qwen2.5-0.5b", "bfloat16", 1)
    raw = os.path.join(ctx.out, "digest_tp2.json")
    if run([ctx.binary("digest_cost"), "--model_dir", model, "--lora_rank", "32", "--tp", "2", "--out", raw,
            "--machine", ctx.machine_line(), "--command", ctx.command_line()], ctx.fails, "digest_cost", env=ctx.env):
        run([sys.executable, "bench/digest_results.py", raw, os.path.join(ctx.out, "ours_lora_fixed.json"),
             os.path.join(ctx.out, "env.txt"), os.path.join(ctx.out, "digest_cost.json")], ctx.fails,
            "digest results", env=ctx.env)


# name -> (what it measures, runner, result files it must leave, parity files that must pass)
MULTI_TENANT_WORKLOADS = {  # name: (model, runs, sequences per call, tokens per sequence, timed steps per run)
    "q05_16x4096": ("qwen2.5-0.5b", 16, 8, 512, 5),
    "q05_32x1024": ("qwen2.5-0.5b", 32, 2, 512, 5),
    "q7b_8x4096": ("qwen2.5-7b", 8, 8, 512, 3),
}


def suite_multi_tenant(ctx):
    env = bench_env(ctx)
    if ctx.args.profile:
        env["PROFILE"] = "1"
    for name in ctx.args.multi_tenant:
        preset, runs, seqs, length, steps = MULTI_TENANT_WORKLOADS[name]
        if preset == "qwen2.5-7b":  # written by transformers itself, as the step7b suite does
            model = "/tmp/q7b_hf"
            if not run([sys.executable, "bench/make_hf_model.py", "--shape", preset, "--out", model], ctx.fails,
                       "7B model", env=ctx.env):
                continue
        else:
            model = ctx.model(preset, "bfloat16", 1)
        run(["bash", "bench/multi_tenant.sh", ctx.build, model, "cuda", ctx.out, name, str(runs), str(seqs),
             str(length), str(steps)], ctx.fails, f"multi-tenant {name}", env=env,
            log=os.path.join(ctx.out, f"multi_tenant_{name}.log"))
    run([sys.executable, "bench/multi_tenant_results.py", ctx.out, os.path.join(ctx.out, "multi_tenant.json")],
        ctx.fails, "multi-tenant results", env=ctx.env)


def suite_sampler(ctx):
    run(["bash", "bench/sampler_gpu.sh", ctx.build, ctx.out, " ".join(ctx.args.sampler_shapes),
         ",".join(str(b) for b in ctx.args.sampler_batches), str(ctx.args.sampler_prompt), str(ctx.args.sampler_new)],
        ctx.fails, "sampler against transformers generate", env=bench_env(ctx), log=os.path.join(ctx.out, "sampler.log"))


SUITES = {
    "dgrad": ("the flattened dgrad microbenchmark", suite_dgrad, lambda a: ["dgrad.json"], lambda a: []),
    "parity": ("0.5B log-probs and LoRA gradients against transformers + PEFT", suite_parity,
               lambda a: [], lambda a: [f"hf_parity_{d}.json" for d in a.dtype or ["float32", "bfloat16"]]),
    "parity-head": ("as parity, with LoRA on the LM head too", suite_parity_head,
                    lambda a: [], lambda a: [f"hf_parity_head_{d}.json" for d in a.dtype or ["float32", "bfloat16"]]),
    "moe-parity": ("tiny Qwen2-MoE and Qwen3-MoE against transformers", suite_moe_parity, lambda a: [],
                   lambda a: [f"moe_parity_{p}_{d}.json" for p in ("tiny-moe", "tiny-qwen3-moe")
                              for d in a.dtype or ["float32", "bfloat16"]]),
    "families": ("every family and RoPE variant against transformers + PEFT", suite_families,
                 lambda a: [], lambda a: ["families.json"]),
    "step": ("0.5B LoRA and full steps against transformers + PEFT", suite_step, lambda a: ["step.json"],
             lambda a: []),
    "step-families": ("gpt-oss and Qwen3.5 LoRA steps against transformers + PEFT (and the Gated DeltaNet share)",
                      suite_step_families, lambda a: [f"step_{p}.json" for p in a.step_families], lambda a: []),
    "step7b": ("the 7B-class LoRA step against transformers + PEFT", suite_step7b, lambda a: ["step_7b.json"],
               lambda a: []),
    "long": ("32k-131k-token sequences and recomputation's cost", suite_long, lambda a: ["long_context.json"],
             lambda a: []),
    "attention": ("attention kernels (SDPA backends, flash varlen)", suite_attention,
                  lambda a: ["attention_backends.json"], lambda a: []),
    "gemm-rows": ("the 7B layer's frozen GEMMs by row count: one GEMM against 4,096- and 8,192-row chunks",
                  suite_gemm_rows, lambda a: ["gemm_rows.json"], lambda a: []),
    "attention-gqa": ("SDPA reading grouped K/V heads against repeating them", suite_attention_gqa,
                      lambda a: ["attention.json"], lambda a: []),
    "moe-bench": ("the MoE step (reduced Qwen3-30B-A3B) against transformers", suite_moe_bench,
                  lambda a: ["moe_hf_fwdbwd.json"] + [f"moe_ours_{l}_4096.json" for l in a.moe_layout],
                  lambda a: []),
    "digest": ("the digest check's share of the LoRA step (after 'step')", suite_digest,
               lambda a: ["digest_cost.json"], lambda a: []),
    "service": ("service overhead per deployment (0.5B, 64 x 512)", suite_service,
                lambda a: [f"service_overhead_{d}.json" for d in a.deployment]
                + [f"service_split_{d}.json" for d in a.deployment if a.service_log]
                + [f"service_overhead_{d}{v}.json" for v in ["_tuned_client"] * a.service_tuned_client
                   + ["_v2"] * a.service_log + ["_pinned"] * bool(a.service_pin) for d in a.deployment],
                lambda a: []),
    "autosave": ("autosave's cost on the step", suite_autosave,
                 lambda a: [f"autosave_{d}.json" for d in a.deployment], lambda a: []),
    "multi-tenant": ("many runs on one base: co-scheduled against one at a time", suite_multi_tenant,
                     lambda a: ["multi_tenant.json"], lambda a: []),
    "sampler": ("the sampler's decode against transformers generate + PEFT", suite_sampler,
                lambda a: ["sampler_gpu.json"], lambda a: []),
    "multi-gpu": ("NCCL layouts against world size 1 and their speedups", suite_multi_gpu,
                  lambda a: ["multi_gpu.json"], lambda a: []),
}


def verify(ctx, names):
    for name in names:
        _, _, outputs, passing = SUITES[name]
        require(ctx, outputs(ctx.args))
        for f in passing(ctx.args):
            require_pass(ctx, f)


def cmd_suite(ctx, names):
    if not os.path.exists(os.path.join(ctx.out, "env.txt")):
        ctx.write_env()
    for name in names:
        banner(f"suite {name}: {SUITES[name][0]}")
        started = time.time()
        SUITES[name][1](ctx)
        verify(ctx, [name])
        print(f"suite {name}: {time.time() - started:.0f} s", flush=True)


def pack_raw(ctx, names):
    """Leaves in OUT only env.txt, the named suites' result files (in the order the suites
    name them, the headline figures first) and bench.log, at most --keep-files files with
    raw.tgz; every other top-level file goes into OUT/raw.tgz (generated batch files are
    dropped), so a caller that copies back only a few files from a remote machine still gets
    the results that matter most."""
    wanted = ["env.txt"]
    for name in names:
        _, _, outputs, passing = SUITES[name]
        wanted += [f for f in outputs(ctx.args) + passing(ctx.args) if f not in wanted]
    wanted.append("bench.log")
    present = [f for f in wanted if os.path.isfile(os.path.join(ctx.out, f))]
    keep = set(present[:max(ctx.args.keep_files - 1, 0)])  # one place for raw.tgz
    extra = sorted(f for f in os.listdir(ctx.out)
                   if os.path.isfile(os.path.join(ctx.out, f)) and f not in keep and f != "raw.tgz")
    packed = [f for f in extra if not f.startswith("batch_")]
    if packed:
        import tarfile
        with tarfile.open(os.path.join(ctx.out, "raw.tgz"), "w:gz") as tar:
            for f in packed:
                tar.add(os.path.join(ctx.out, f), arcname=f)
    for f in extra:
        os.remove(os.path.join(ctx.out, f))
    over = [f for f in present if f not in keep]
    print(f"pack-raw: {len(packed)} file(s) into raw.tgz, {len(extra) - len(packed)} batch file(s) dropped"
          + (f"; results over --keep-files {ctx.args.keep_files} packed too: {' '.join(over)}" if over else ""),
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="suites:\n" + "\n".join(f"  {n:14} {s[0]}" for n, s in SUITES.items()))
    ap.add_argument("--build-dir", default=os.path.join(REPO, "build-gpu"), help="CMake build folder")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "out"),
                    help="where results and logs go (default: $OUT where set, else ./out)")
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "lorastep-models"),
                    help="generated models, one folder per preset, dtype and seed")
    ap.add_argument("--sysroot", default=os.path.join(REPO, ".sysroot"), help="the carried Debian sysroot")
    ap.add_argument("--cuda-arch", default="90", help="CUDA architecture to compile for (90: H100/H200)")
    ap.add_argument("--commit", help="the commit the results come from (default: git HEAD, where there is a checkout)")
    ap.add_argument("--target", action="append", help="build only these CMake targets (repeatable)")
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="test/parity dtypes")
    ap.add_argument("--tests", help="ctest -R regex (default: every test)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device the tests run on")
    ap.add_argument("--suite", action="append", default=[], choices=sorted(SUITES), help="with 'all'")
    ap.add_argument("--step7b-mbs", nargs="+", default=["8192"], help="step7b: micro-batch sizes (first = headline)")
    ap.add_argument("--profile", action="store_true", help="step7b, multi-tenant: also a Kineto profile of one step (one per side)")
    ap.add_argument("--multi-tenant", nargs="+", default=list(MULTI_TENANT_WORKLOADS),
                    choices=sorted(MULTI_TENANT_WORKLOADS), help="multi-tenant: workloads")
    ap.add_argument("--long-runs", nargs="*", default=[], help="long: runs (default all: q7b_32768 recompute "
                                                               "q05_131072 q7b_131072)")
    ap.add_argument("--families-only", help="families: comma-separated subset")
    ap.add_argument("--step-families", nargs="+", default=sorted(STEP_FAMILIES), choices=sorted(STEP_FAMILIES),
                    help="step-families: which models (gpt_oss: gpt-oss-20b-reduced, qwen3_5: qwen3.5-9b)")
    ap.add_argument("--deployment", nargs="+", default=["process", "in_process"], choices=sorted(DEPLOYMENTS),
                    help="service/autosave: worker deployments (process_grpc: spawned, per-step calls over gRPC)")
    ap.add_argument("--steps", type=int, default=10, help="service: timed steps")
    ap.add_argument("--service-tuned-client", action="store_true",
                    help="service: each deployment once more with the client's large buffers kept in its heap "
                         "(service_overhead --tune_malloc)")
    ap.add_argument("--service-pin", metavar="SERVER_CPUS/CLIENT_CPUS",
                    help="service: each deployment once more with the coordinator (and the worker it spawns) "
                         "pinned to SERVER_CPUS and the client to CLIENT_CPUS (taskset lists, e.g. 0-7/8)")
    ap.add_argument("--service-log", action="store_true",
                    help="service: each deployment once more with --v=2 call durations, split per step by "
                         "bench/service_split.py into service_split_<deployment>.json")
    ap.add_argument("--moe-layout", nargs="+", default=["shared_outer", "per_expert"],
                    choices=["shared_outer", "per_expert"], help="moe-bench: expert LoRA layouts")
    ap.add_argument("--pack-raw", action="store_true",
                    help="afterwards keep only the suites' results, env.txt and bench.log in OUT; the rest into raw.tgz")
    ap.add_argument("--keep-files", type=int, default=8,
                    help="--pack-raw: files left in OUT at most, raw.tgz included")
    ap.add_argument("--sampler-shapes", nargs="+", default=["0.5b", "7b"], choices=["0.5b", "7b"], help="sampler: shapes")
    ap.add_argument("--sampler-batches", nargs="+", type=int, default=[1, 16, 64, 256], help="sampler: batch sizes")
    ap.add_argument("--sampler-prompt", type=int, default=512, help="sampler: prompt tokens")
    ap.add_argument("--sampler-new", type=int, default=512, help="sampler: new tokens per sequence")
    ap.add_argument("command", choices=["build", "check", "suite", "all", "verify", "list"])
    ap.add_argument("names", nargs="*", help="suite names (suite, verify)")
    args = ap.parse_args(argv)
    if args.command == "list":
        for n, s in SUITES.items():
            print(f"{n:14} {s[0]}; writes {', '.join(s[2](args) + s[3](args)) or '(see its script)'}")
        return 0
    unknown = [n for n in args.names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {', '.join(unknown)}; 'list' shows them")
    if args.command in ("suite", "verify") and not args.names:
        ap.error(f"'{args.command}' needs suite names; 'list' shows them")
    fails = Failures()
    ctx = Context(args, fails)
    if args.command == "verify":
        verify(ctx, args.names)
    elif args.command == "build":
        cmd_build(ctx)
    elif args.command == "check":
        cmd_check(ctx)
    elif args.command == "suite":
        cmd_suite(ctx, args.names)
    elif args.command == "all":
        ctx.write_env()
        if cmd_build(ctx):
            cmd_check(ctx)
            cmd_suite(ctx, args.suite)
    if args.pack_raw and args.command in ("suite", "all", "verify"):
        pack_raw(ctx, args.suite if args.command == "all" else args.names)
    return fails.exit_code()


if __name__ == "__main__":
    sys.exit(main())
