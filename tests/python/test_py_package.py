"""Issue 44: `pip install .` as a user runs it, then the package from outside.

A fresh virtual environment gets the pinned torch of the suite's own
environment (a .pth line, not a copy: "a venv with torch already in it") and
`pip install <checkout>` -- build isolation on, as pip's default: the library
must still be compiled against the environment's torch
(cmake/ddpxPythonPackage.cmake). Then, with neither DDPX_LIB nor PYTHONPATH:
`import ddpx` loads the installed library; ddpx_mpi works after the import and,
through torch's backend autoload, with no import; the modules and ops run; a
C++ program built with find_package(ddpx) under ddpx.cmake_prefix_path loads a
module scripted from ddpx.nn; `pip wheel` gives a wheel whose libraries find
torch's relative to themselves. A torch outside the supported range is refused
at configure time, a torch other than the one built against at import.

The build goes to <checkout>/build-pip (pyproject.toml), so a second run only
rebuilds what changed. DDPX_WITH_CUDA is left as a user leaves it (AUTO: the
CUDA kernels where nvcc is found; DDPX_PIP_CUDA overrides), which is also how
the main build was configured, so ccache serves nearly every object of a
fresh clone's pip build from that build's (47 of 50 measured).
"""
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))
from ddpx import _loader  # noqa: E402  (pure Python: no library needed)

MPIEXEC = os.environ.get("DDPX_MPIEXEC", "mpirun")
CUDA = os.environ.get("DDPX_PIP_CUDA", "AUTO")


def run(cmd, env=None, timeout=1500, check=True, cwd=None):
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def user_env(**extra):
    """The environment of a user's shell: none of the suite's own variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DDPX_LIB", "PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("venv")
    run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", d])
    py = d / "bin" / "python"
    purelib = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    Path(purelib.strip(), "_ddpx_test_torch.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    t0 = time.monotonic()
    run([py, "-m", "pip", "install", "-q", ROOT, "-C", f"cmake.define.DDPX_WITH_CUDA={CUDA}"],
        env=user_env())
    print(f"pip install . took {time.monotonic() - t0:.0f} s")
    return py, Path(purelib.strip())


def py_run(venv, code, **env):
    return run([venv[0], "-c", code], env=user_env(**env), timeout=300)


def test_import_loads_the_installed_library(venv):
    out = py_run(venv, "import ddpx, torch\n"
                       "print(ddpx.library_path()); print(ddpx.cmake_prefix_path)\n"
                       "print(ddpx.__version__)\n"
                       "print(torch.ops.ddpx.tiled_conv2d.default.name())").stdout.split("\n")
    lib, prefix, version, op = out[:4]
    assert Path(lib) == venv[1] / "ddpx" / "lib" / "libddpx.so"
    assert (Path(prefix) / "lib" / "cmake" / "ddpx" / "ddpxConfig.cmake").exists()
    assert version == run(["grep", "-oP", r"project\(ddpx VERSION \K[0-9.]+",
                           ROOT / "CMakeLists.txt"]).stdout.strip()
    assert op == "ddpx::tiled_conv2d"


def test_modules_and_ops_from_the_package(venv):
    py_run(venv, """
import torch, ddpx
torch.manual_seed(0)
ref = torch.nn.Conv2d(3, 5, 3, padding=1)
ours = ddpx.nn.TiledConv2d(3, 5, 3, padding=1)
ours.load_state_dict(ref.state_dict())
x = torch.randn(2, 3, 9, 7)
torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
# the eager calls' direct entry, from the package's own glue library
assert ddpx.ops._C is not None and ddpx.ops._fast_ok(x, ours.weight, ours.bias)
gru = torch.nn.GRU(4, 6, batch_first=True)
y, h = ddpx.ops.fused_gru(torch.randn(2, 5, 4), None, gru._flat_weights, batch_first=True)
assert y.shape == (2, 5, 6) and h.shape == (1, 2, 6)
""")


MPI_SNIPPET = """
import torch, torch.distributed as dist
{imp}
dist.init_process_group("ddpx_mpi")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 3, t
print("allreduce ok on", dist.get_backend())
dist.destroy_process_group()
"""


def mpirun(venv, code, **env):
    return run([MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", "2", venv[0], "-c",
                code], env=user_env(**env), timeout=300)


def test_ddpx_mpi_after_import(venv):
    assert "allreduce ok on ddpx_mpi" in mpirun(venv, MPI_SNIPPET.format(imp="import ddpx")).stdout


def test_ddpx_mpi_through_autoload_without_import(venv):
    out = mpirun(venv, MPI_SNIPPET.format(imp=""), TORCH_DEVICE_BACKEND_AUTOLOAD="1").stdout
    assert "allreduce ok on ddpx_mpi" in out
    # Autoload off: nothing registers the backend (what made the run above work).
    off = py_run(venv, "import torch.distributed as dist; print('ddpx_mpi' in "
                       "dist.Backend.backend_list)", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.stdout.strip() == "False"


def test_readme_quick_start_runs_verbatim(venv):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\n# Python: pip install .") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    mpirun(venv, code + "\nprint('quick start ok', dist.get_rank())\n")


def test_cpp_program_loads_a_module_scripted_from_ddpx_nn(venv, tmp_path):
    script = tmp_path / "export.py"  # a file: TorchScript reads the classes' source
    script.write_text(f"""
import torch, ddpx

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = ddpx.nn.TiledConv2d(3, 4, 3, padding=1)
        self.gru = ddpx.nn.FusedGRU(4 * 6, 8, batch_first=True)
    def forward(self, x):
        y = torch.relu(self.conv(x))                    # [N, 4, 5, 6]
        seq = y.permute(0, 2, 1, 3).flatten(2)          # [N, 5, 24]
        return self.gru(seq)[0]

class Case(torch.nn.Module):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

torch.manual_seed(0)
net = torch.jit.script(Net().eval())
assert "ddpx.tiled_conv2d" in net.conv._conv_forward.code
x = torch.randn(2, 3, 5, 6)
net.save("{tmp_path}/net.pt")
torch.jit.script(Case(x, net(x).detach())).save("{tmp_path}/case.pt")
""")
    run([venv[0], script], env=user_env(), timeout=300)
    prefix = py_run(venv, "import ddpx, torch.utils; print(ddpx.cmake_prefix_path + ';' + "
                          "torch.utils.cmake_prefix_path)").stdout.strip()
    build = tmp_path / "build"
    run(["cmake", "-S", ROOT / "tests" / "python" / "jit_consumer", "-B", build, "-G", "Ninja",
         f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"], env=user_env())
    run(["cmake", "--build", build], env=user_env())
    out = run([build / "jit_consumer", tmp_path / "net.pt", tmp_path / "case.pt"],
              env=user_env()).stdout
    assert "jit consumer ok" in out, out


def test_wheel_libraries_find_torch_relative_to_themselves(venv, tmp_path):
    run([venv[0], "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path, ROOT, "-C",
         f"cmake.define.DDPX_WITH_CUDA={CUDA}"], env=user_env())
    wheel, = tmp_path.glob("ddpx-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "ddpx/__init__.py" in names and "ddpx/_build_info.py" in names
        for lib in ("ddpx/lib/libddpx.so", "ddpx/lib/libddpx_python.so"):
            assert lib in names
            z.extract(lib, tmp_path)
            dyn = run(["readelf", "-d", tmp_path / lib]).stdout
            runpath = [ln for ln in dyn.splitlines() if "RUNPATH" in ln or "RPATH" in ln]
            assert runpath and "$ORIGIN/../../torch/lib" in runpath[0], dyn
            assert str(ROOT) not in runpath[0] and "site-packages" not in runpath[0], runpath
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
        assert "[torch.backends]" in entry and "ddpx = ddpx:_autoload" in entry


def test_configure_refuses_an_unsupported_torch(tmp_path):
    fake = tmp_path / "fake"
    (fake / "torch" / "utils").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.9.0"\n')
    (fake / "torch" / "utils" / "__init__.py").write_text('cmake_prefix_path = "/nowhere"\n')
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = run(["cmake", "-S", ROOT, "-B", tmp_path / "build", "-DSKBUILD=2",
                f"-DPython3_EXECUTABLE={python}", "-DDDPX_WITH_CUDA=OFF"], env=user_env(),
               check=False)
    assert proc.returncode != 0
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "ddpx supports PyTorch 2.11 to 2.15" in text and "has torch 2.9.0" in text, text


def test_import_refuses_another_torch_than_built_against():
    _loader.check_torch_version("2.15.0", "2.15.0+cu132")  # the local tag does not matter
    _loader.check_torch_version(None, "2.15.0")  # a source tree: nothing recorded
    with pytest.raises(ImportError, match=r"built against torch 2\.11\.0 but this Python runs "
                                          r"torch 2\.15\.0"):
        _loader.check_torch_version("2.11.0", "2.15.0")
