"""Every test runs on 8 virtual CPU devices, with one persistent compilation cache shared by the
test process and the training subprocesses it starts (the cache keeps results bit-identical)."""
import os
import pathlib

CACHE_DIR = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax-tests"
# The measured CPU peak (train/runtime/cpu_peak.py) of the suite's own, shared by its processes: a test never reads
# or writes the user's ~/.cache/spmdtrain.
os.environ["SPMDTRAIN_CACHE_DIR"] = str(CACHE_DIR.parent / "spmdtrain-tests")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
# Every compile is cached, however short: a training subprocess then loads its small programs (init, eval,
# checksums, layer reorders) too, instead of compiling them again in each of the suite's ~40 runs.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Tiny programs: XLA's CPU compile time is mostly LLVM's optimizer and the fusion emitters, and no test needs
# fast code. At optimization level 0 the suite compiles in about a quarter less CPU time, and XLA's classic
# elemental emitters in place of its MLIR fusion emitters cut the CPU time of a cold suite by another quarter
# (16.5 -> 12 user minutes, docs/testing.md). XLA's CPU floating point has no fast-math either way, and a run and
# its reference always compile with the same flags (subprocesses inherit them). A user's own setting in
# XLA_FLAGS is kept.
def _known_to_xla(flag: str) -> bool:
    """Whether the installed jaxlib registers `flag`: XLA aborts the process on a flag it does not know, and a
    later jaxlib may drop this one."""
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    library = pathlib.Path(spec.origin).parent / "libjax_common.so" if spec and spec.origin else None
    if library is None or not library.is_file():
        return False
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(flag.encode()) >= 0


for _name, _value in (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false")):
    if _name not in os.environ.get("XLA_FLAGS", "") and (_name == "xla_backend_optimization_level"
                                                           or _known_to_xla(_name)):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# The slowest files first (the slowest tests are listed in docs/testing.md): `make test` hands whole files to two
# workers in this order (--no-loadscope-reorder) rather than xdist's (the most tests first), so a long file
# does not start last. Files not named keep pytest's order, after these.
SLOWEST_FIRST = ["test_checkpoint_runs.py", "test_pipeline.py", "test_multiprocess.py", "test_slurm.py", "test_rl.py",
                 "test_deepseek.py", "test_moe.py", "test_compositions.py", "test_context.py", "test_planner.py",
                 "test_equivalence.py", "test_audit.py", "test_llama.py", "test_attention_loss.py",
                 "test_documents.py", "test_run_phases.py", "test_train_cli.py", "test_bench_gpu.py", "test_model.py",
                 "test_checkpoint.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random tiny LlamaForCausalLM saved by transformers (tests/hf_models.py; the `hf` extra, else skipped): the
    base the Hugging Face import, LoRA and export tests start from."""
    pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
    from tests import hf_models
    return hf_models.save_llama(tmp_path_factory.mktemp("hf") / "llama")
