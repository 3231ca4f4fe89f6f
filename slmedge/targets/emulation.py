"""arm64 under emulation: qemu user mode runs an aarch64 Python with onnxruntime and an aarch64
build of llama.cpp, so evaluations exercise the real ARM kernels (NEON, dot-product) on the
exported file. Timings from here are emulated and never reported as device latency.

``slmedge targets setup arm64`` builds the environment once into the user cache:

1. ``qemu-aarch64``: the one on PATH, else Debian's ``qemu-user-static`` package unpacked;
2. a sysroot of Debian's arm64 ``python3.11`` and its libraries, downloaded with a private apt
   configuration (nothing is installed on this machine) and unpacked with ``dpkg-deb -x``;
3. aarch64 wheels (numpy, onnxruntime, onnxruntime-genai, llama-cpp-python's pure-Python
   dependencies) put in with this machine's pip (``--platform manylinux..._aarch64``, 2_28
   included: onnxruntime-genai's tag; Debian 12's glibc is 2.36);
4. llama.cpp's shared libraries cross-compiled (``aarch64-linux-gnu-g++``, armv8.2-a with dot
   product and fp16, no OpenMP) from the sources of the llama-cpp-python release installed here,
   behind a copy of its Python binding, so the same binding code runs on both sides;
5. the pitfalls seen on qemu handled: a fake ARM ``/proc/cpuinfo`` in the sysroot
   (onnxruntime reads it at import), a named CPU (``-cpu max`` gave wrong int8 results on qemu
   7.2), the standard library precompiled, threads never above the cores.

An environment that passed its check before is brought up to date in place when only wheels
changed (a runtime registered since, another version here): those wheels are added to it, the
sysroot and the llama.cpp build are kept (``--rebuild`` builds everything again).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ..errors import TargetError
from ..fsutil import write_json_atomic
from ..procs import child_options
from .profiles import Profile
from .registry import register_transport
from .transports import Check, Transport, runner_bundle

PYTHON = "python3.11"
DEB_PACKAGES = ["python3.11", "libstdc++6", "libgcc-s1"]
WHEELS = ["typing-extensions", "diskcache", "jinja2", "MarkupSafe"]  # + numpy, onnxruntime as on this machine
ARM_ARCH = "armv8.2-a+dotprod+fp16"
SETUP_VERSION = 1
FAKE_CPUINFO = """processor\t: {i}
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

"""


ENVS_ENV = "SLMEDGE_TARGET_ENVS"


def env_root() -> Path:
    """``$SLMEDGE_TARGET_ENVS/arm64``, else ``<user cache>/targets/arm64``."""
    from ..paths import cache_dir

    base = os.environ.get(ENVS_ENV)
    return (Path(base).expanduser() if base else cache_dir() / "targets") / "arm64"


def _qemu(root: Path) -> str | None:
    for name in ("qemu-aarch64-static", "qemu-aarch64"):
        found = shutil.which(name)
        if found:
            return found
    local = root / "qemu" / "usr" / "bin" / "qemu-aarch64-static"
    return str(local) if local.is_file() else None


@register_transport("emulated")
class EmulatedTransport(Transport):
    """The runner under qemu. ``manifest``: the environment's record when it is not (yet) the one
    in ``env.json`` (setup checks the runner before it writes that file)."""

    emulated = True

    def __init__(self, profile: Profile, root: Path | None = None, manifest: dict | None = None):
        super().__init__(profile)
        self.root = root or env_root()
        self.timeout = 6 * 3600.0
        self._manifest = manifest

    @classmethod
    def check_profile(cls, data: dict, where: str) -> None:
        """Only runtimes the emulated environment can hold (an aarch64 build of each); by default, all of them."""
        from ..errors import ConfigError
        from ..runtimes.registry import get_runtime

        for name in data.get("runtimes", []):
            spec = get_runtime(name)
            if spec.runs_files and not spec.arm64:
                raise ConfigError(f"{where}: {_no_build(spec.name)}")
        if "runtimes" not in data:
            data["runtimes"] = [s.name for s in _arm64_runtimes()]
        super().check_profile(data, where)

    @classmethod
    def runtime_refusal(cls, profile: Profile, runtime: str) -> str | None:
        from ..runtimes.registry import get_runtime

        spec = get_runtime(runtime)
        if spec.runs_files and not spec.arm64:
            return f"target '{profile.name}' cannot run {spec.name}: {_no_build(spec.name)}"
        return super().runtime_refusal(profile, runtime)

    @property
    def where(self) -> str:
        return f"target '{self.profile.name}' (aarch64 under qemu, emulated)"

    def manifest(self) -> dict:
        if self._manifest is not None:
            return self._manifest
        f = self.root / "env.json"
        if not f.is_file():
            raise TargetError(f"{self.where} is not set up: run `slmedge targets setup {self.profile.name}` "
                              f"(builds an aarch64 Python and runtimes into {self.root}, a few minutes, once)")
        return json.loads(f.read_text(encoding="utf-8"))

    def runner_argv(self, args):
        m = self.manifest()
        qemu = _qemu(self.root)
        if qemu is None:
            raise TargetError(f"{self.where}: qemu-aarch64 is gone; run `slmedge targets setup {self.profile.name}`")
        sysroot = self.root / "sysroot"
        return [qemu, "-L", str(sysroot), "-cpu", self.profile.qemu_cpu or m.get("qemu_cpu", "neoverse-n1"),
                str(sysroot / "usr" / "bin" / PYTHON), "-B", str(runner_bundle()), *args]

    def runner_env(self):
        # A clean environment: nothing of this machine's Python may leak into the emulated one.
        return {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
                "OMP_NUM_THREADS": str(max(1, self.profile.threads or 1)),
                "LD_LIBRARY_PATH": str(_site(self.root) / "llama_cpp" / "lib")}

    def is_set_up(self) -> bool:
        return up_to_date()

    def setup(self, log=print, rebuild: bool = False, llama_cpp: bool = True) -> dict:
        return setup_arm64(self.profile, log=log, rebuild=rebuild, llama_cpp=llama_cpp)

    def start_hint(self):
        return f"slmedge targets setup {self.profile.name}"

    def runtime_hint(self, runtime):
        return f"slmedge targets setup {self.profile.name} (rebuilds the emulated environment)"

    def checks(self):
        out = [Check("qemu-aarch64", _qemu(self.root) is not None, _qemu(self.root) or "not found",
                     "apt-get install qemu-user-static (or let `slmedge targets setup arm64` unpack it)")]
        try:
            m = self.manifest()
            out.append(Check("environment", True, f"{self.root} (built {m.get('built_at')})"))
        except TargetError as exc:
            return out + [Check("environment", False, str(exc), self.start_hint())]
        if (self.profile.threads or 1) > (os.cpu_count() or 1):
            out.append(Check("threads", False, f"{self.profile.threads} threads on {os.cpu_count()} cores",
                             "never emulate more threads than cores (15x slower)"))
        return out + super().checks()


# --- setup ------------------------------------------------------------------------------------


def _run(cmd, what: str, cwd=None, env=None, timeout=3600) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=timeout, **child_options())
    except FileNotFoundError as exc:
        raise SetupError(f"{what}: {cmd[0]} is not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{what}: did not finish in {timeout} s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise SetupError(f"{what} failed:\n{tail}")
    return proc


class SetupError(TargetError):
    """Building an emulated environment failed."""


def _codename() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "bookworm"


def _apt_config(root: Path) -> dict:
    apt = root / "apt"
    for d in ("state/lists/partial", "cache/archives/partial", "etc/apt.conf.d", "etc/preferences.d",
              "etc/sources.list.d"):
        (apt / d).mkdir(parents=True, exist_ok=True)
    (apt / "state" / "status").touch()
    suite = _codename()
    key = "/usr/share/keyrings/debian-archive-keyring.gpg"
    opts = f"[arch=arm64 signed-by={key}]" if Path(key).is_file() else "[arch=arm64]"
    (apt / "etc" / "sources.list").write_text(
        f"deb {opts} http://deb.debian.org/debian {suite} main\n"
        f"deb {opts} http://deb.debian.org/debian {suite}-updates main\n"
        f"deb {opts} http://deb.debian.org/debian-security {suite}-security main\n")
    conf = apt / "apt.conf"
    conf.write_text("\n".join([
        f'Dir::State "{apt}/state";', f'Dir::State::status "{apt}/state/status";', f'Dir::Cache "{apt}/cache";',
        f'Dir::Etc::SourceList "{apt}/etc/sources.list";', f'Dir::Etc::SourceParts "{apt}/etc/sources.list.d";',
        f'Dir::Etc::Parts "{apt}/etc/apt.conf.d";', f'Dir::Etc::PreferencesParts "{apt}/etc/preferences.d";',
        'APT::Architecture "arm64";', 'APT::Architectures { "arm64"; };', 'Acquire::Languages "none";',
        'APT::Sandbox::User "root";', 'APT::Install-Recommends "false";', ""]))
    return {**os.environ, "APT_CONFIG": str(conf), "DEBIAN_FRONTEND": "noninteractive"}


def _unpack_debs(debs, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        _run(["dpkg-deb", "-x", deb, dest], f"unpacking {Path(deb).name}")


def _setup_qemu(root: Path, log) -> str:
    found = _qemu(root)
    if found:
        return found
    log("downloading Debian's qemu-user-static (this machine's architecture)")
    with tempfile.TemporaryDirectory() as tmp:
        _run(["apt-get", "download", "qemu-user-static"], "apt-get download qemu-user-static", cwd=tmp)
        _unpack_debs(list(Path(tmp).glob("*.deb")), root / "qemu")
    found = _qemu(root)
    if not found:
        raise SetupError("qemu-user-static did not provide qemu-aarch64-static; install it: apt-get install "
                         "qemu-user-static")
    return found


def _setup_sysroot(root: Path, log) -> None:
    sysroot = root / "sysroot"
    env = _apt_config(root)
    log("downloading Debian arm64 python3.11 and its libraries (private apt configuration)")
    _run(["apt-get", "update", "-q"], "apt-get update (arm64 lists)", env=env, timeout=900)
    _run(["apt-get", "install", "-y", "-q", "--download-only", *DEB_PACKAGES], "apt-get download (arm64)", env=env,
         timeout=1800)
    debs = sorted((root / "apt" / "cache" / "archives").glob("*.deb"))
    if not debs:
        raise SetupError("apt downloaded no arm64 packages")
    log(f"unpacking {len(debs)} packages")
    _unpack_debs(debs, sysroot)
    proc = sysroot / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "cpuinfo").write_text("".join(FAKE_CPUINFO.format(i=i) for i in range(os.cpu_count() or 1)))


def _site(root: Path) -> Path:
    return root / "sysroot" / "usr" / "lib" / "python3" / "dist-packages"


def _wheel_specs(packages) -> list[str]:
    """``pkg==<this machine's version>`` for each package (outputs compare), else the bare name."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in packages:
        try:
            out.append(f"{pkg}=={version(pkg)}")
        except PackageNotFoundError:
            out.append(pkg)
    return out


def _pip_aarch64(root: Path, wheels: list[str], *extra: str) -> None:
    _run([sys.executable, "-m", "pip", "install", "-q", "--target", _site(root), "--upgrade", "--only-binary=:all:",
          "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64",
          "--platform", "manylinux_2_17_aarch64", "--python-version", "3.11", "--implementation", "cp", *extra,
          *wheels], "pip install (aarch64 wheels)", timeout=1800)


def _setup_wheels(root: Path, log) -> None:
    wheels = list(WHEELS) + _wheel_specs(("numpy", *(s.package for s in _arm64_runtimes("wheel"))))
    log("installing aarch64 wheels: " + ", ".join(wheels))
    _pip_aarch64(root, wheels)


def _add_wheels(root: Path, packages: list[str], log) -> None:
    """Put ``packages`` (this machine's versions) into an environment that has their dependencies."""
    wheels = _wheel_specs(packages)
    log("adding aarch64 wheels to the environment: " + ", ".join(wheels))
    _pip_aarch64(root, wheels, "--no-deps")


def _wheels_to_add(root: Path, record) -> list[str] | None:
    """The wheels an environment that passed its check (``record``) lacks, or has in another
    version than this machine, when that is all it lacks; None: it needs the whole setup."""
    if not isinstance(record, dict) or not isinstance(record.get("wanted"), dict) or not record["wanted"]:
        return None
    have, want = record["wanted"], _wanted()
    # The runtimes it was built with (a record without the list: those whose package it wanted).
    had = record.get("runtimes") or [s.name for s in _arm64_runtimes() if s.package in have]
    if check_problems(record.get("versions"), had) or not (root / "sysroot" / "usr" / "bin" / PYTHON).is_file():
        return None
    changed = [k for k in want if have.get(k) != want[k]] + [k for k in have if k not in want]
    wheels = {"numpy", *(s.package for s in _arm64_runtimes("wheel"))}
    if any(k not in wheels for k in changed):  # the setup itself, or a built runtime: everything again
        return None
    return [k for k in changed if k in want and want[k] is not None]


def _cross_compilers() -> tuple[str, str] | None:
    cc, cxx = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("aarch64-linux-gnu-g++")
    return (cc, cxx) if cc and cxx else None


def _setup_llama_cpp(root: Path, log) -> str:
    from ..backends.llamacpp import require_llama_cpp

    host = require_llama_cpp()
    version = host.__version__
    compilers = _cross_compilers()
    if compilers is None:
        raise SetupError("no aarch64 cross compiler: apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu "
                         "(then run setup again; onnxruntime works without it)")
    build = root / "build"
    src_root = build / "src"
    if not (src_root / "ok").is_file():
        shutil.rmtree(src_root, ignore_errors=True)
        src_root.mkdir(parents=True)
        log(f"fetching llama-cpp-python {version} sources (pip download)")
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", src_root,
              f"llama-cpp-python=={version}"], "pip download llama-cpp-python (sdist)", timeout=1800)
        sdist = next(src_root.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(src_root, filter="data")
        (src_root / "ok").touch()
    vendor = next(src_root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    cc, cxx = compilers
    out = build / "aarch64"
    log(f"cross-compiling llama.cpp for aarch64 ({ARM_ARCH}; a few minutes on 2 cores)")
    _run(["cmake", "-S", vendor, "-B", out, "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_SYSTEM_NAME=Linux",
          "-DCMAKE_SYSTEM_PROCESSOR=aarch64", f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}",
          "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_RPATH=$ORIGIN", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", f"-DGGML_CPU_ARM_ARCH={ARM_ARCH}",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
          "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"], "cmake configure (aarch64)", timeout=600)
    _run(["cmake", "--build", out, "--target", "llama", "-j", str(os.cpu_count() or 2)], "cmake build (aarch64)",
         timeout=3600)
    # The binding: the same Python files as on this machine, the aarch64 libraries in its lib/.
    pkg = _site(root) / "llama_cpp"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(Path(host.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so*", "server"))
    lib = pkg / "lib"
    lib.mkdir(exist_ok=True)
    libs = [p for p in out.rglob("*.so*") if p.is_file() and not p.is_symlink()]
    for p in libs:
        shutil.copy2(p, lib / p.name)
    for p in out.rglob("*.so*"):  # the soname links (libllama.so -> libllama.so.0 ...)
        if p.is_symlink() and not (lib / p.name).exists():
            os.symlink(os.readlink(p), lib / p.name)
    return version


def _wanted() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"setup_version": SETUP_VERSION}
    for pkg in (*(s.package for s in _arm64_runtimes()), "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _arm64_runtimes(how: str | None = None) -> list:
    """The registered runtimes the emulated arm64 environment has (``how``: only those it installs
    as wheels, or only those it builds)."""
    from ..runtimes.registry import RUNTIMES

    return [s for s in RUNTIMES.values() if s.arm64 and (how is None or s.arm64 == how)]


def _no_build(runtime: str) -> str:
    """Why an emulated arm64 target has no ``runtime`` (its registration's ``arm64=""``)."""
    return (f"no aarch64 Linux build of {runtime} exists for the emulated arm64 environment (no wheel to install, "
            f"nothing slmedge cross-compiles); run it on cpu, or over ssh on a device where {runtime} is installed")


# The runtimes that are cross-compiled rather than installed, and how: runtime name -> builder.
BUILDERS = {"llama.cpp": lambda root, log: _setup_llama_cpp(root, log)}


def check_problems(versions, runtimes=None) -> list[str]:
    """What is wrong with the runner's ``versions`` answer for an environment that should have
    ``runtimes`` (default: every runtime the environment has): nothing (an empty list) when it
    reports aarch64 and a version of each."""
    if runtimes is None:
        runtimes = [s.name for s in _arm64_runtimes()]
    if not isinstance(versions, dict):
        return ["the runner gave no versions"]
    out = []
    if versions.get("machine") != "aarch64":
        out.append(f"the runner reports machine {versions.get('machine')!r}, not 'aarch64'")
    out += [f"no {rt} version (not importable there)" for rt in runtimes if not versions.get(rt)]
    return out


def up_to_date() -> bool:
    """The environment exists, was built by this setup for the runtimes installed here (all of
    them: llama.cpp included), and its runner passed the check at the end of the build."""
    f = env_root() / "env.json"
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("wanted") == _wanted() and not check_problems(record.get("versions"))


def setup_arm64(profile: Profile, log=print, rebuild: bool = False, llama_cpp: bool = True) -> dict:
    root = env_root()
    if rebuild:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    try:
        previous = json.loads((root / "env.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = None
    add = _wheels_to_add(root, previous) if llama_cpp else None
    (root / "env.json").unlink(missing_ok=True)
    t0 = time.time()
    qemu = _setup_qemu(root, log)
    if add is not None:  # it passed before and lacks only wheels: add those, keep the rest
        if add:
            _add_wheels(root, add, log)
        built = dict(previous.get("built") or {})
    else:
        if not (root / "sysroot" / "usr" / "bin" / PYTHON).is_file():
            _setup_sysroot(root, log)
        _setup_wheels(root, log)
        built = {}
        if llama_cpp:  # the runtimes that are built (llama.cpp): skipped with --no-llama-cpp
            for spec in _arm64_runtimes("build"):
                built[spec.name] = BUILDERS[spec.name](root, log)
    log("precompiling the standard library and packages (host Python 3.11: same bytecode)")
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(root / "sysroot" / "usr" / "lib" / PYTHON),
                    str(_site(root))], capture_output=True, **child_options())
    runtimes = [s.name for s in _arm64_runtimes() if llama_cpp or s.arm64 != "build"]
    manifest = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "qemu": qemu,
                "qemu_cpu": profile.qemu_cpu or "neoverse-n1", "arm_arch": ARM_ARCH, "built": built,
                "runtimes": runtimes, "wanted": _wanted() if llama_cpp else {}}
    # The record is written only once the runner has passed: a failed check leaves none, so
    # `--if-needed` builds again and the tests that need the environment do not find one.
    log("checking the runner under emulation")
    try:
        versions = EmulatedTransport(profile, root, manifest=manifest).versions()
    except TargetError as exc:
        raise SetupError(f"the arm64 runner failed its check under emulation: {exc}") from exc
    except (ValueError, IndexError) as exc:  # an answer that is not the runner's JSON line
        raise SetupError("the arm64 runner failed its check under emulation: its `versions` answer is not JSON") \
            from exc
    problems = check_problems(versions, runtimes)
    if problems:
        raise SetupError(f"the arm64 runner failed its check under emulation: {'; '.join(problems)} "
                         f"(run `slmedge targets setup {profile.name} --rebuild`)")
    manifest["versions"] = versions
    manifest["seconds"] = round(time.time() - t0, 1)
    write_json_atomic(root / "env.json", manifest)
    return manifest
