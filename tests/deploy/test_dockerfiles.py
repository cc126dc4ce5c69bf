"""deploy/docker: the four Dockerfiles read instruction by instruction (no Docker here), and .dockerignore.

Checked: base images pinned to exact tags, an unprivileged USER before the process starts, a HEALTHCHECK
that runs `meshserve health`, the settings and ports every container needs, torch pinned to the tested
build (and never installed into the slim services image), every COPY source present in the repository
and inside the build context .dockerignore leaves.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
DOCKERFILES = {
    "services": DOCKER_DIR / "Dockerfile.services",
    "cpu": DOCKER_DIR / "Dockerfile.cpu",
    "ascend": DOCKER_DIR / "Dockerfile.ascend",
    "cuda": DOCKER_DIR / "Dockerfile.cuda",
}
WORKER_IMAGES = ("cpu", "ascend", "cuda")


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str  # upper case
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined. Comment lines are dropped, also inside a
    continuation (Docker does the same); `# syntax=` directives are comments here."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        pending = []
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
    assert not pending, "the file ends inside a continuation"
    return instructions


@cache
def instructions(image: str) -> tuple[Instruction, ...]:
    return tuple(parse_dockerfile(DOCKERFILES[image].read_text(encoding="utf-8")))


def final_stage(image: str) -> list[Instruction]:
    """The instructions from the last FROM on: what the image that runs consists of."""
    all_ = list(instructions(image))
    last_from = max(i for i, ins in enumerate(all_) if ins.keyword == "FROM")
    return all_[last_from:]


def args_defaults(image: str) -> dict[str, str]:
    """ARG NAME=default, anywhere in the file."""
    defaults: dict[str, str] = {}
    for ins in instructions(image):
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), value)


def env_of(image: str) -> dict[str, str]:
    """ENV settings of the final stage (KEY=VALUE pairs, possibly several per instruction)."""
    env: dict[str, str] = {}
    for ins in final_stage(image):
        if ins.keyword == "ENV":
            for token in shlex.split(ins.args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV {ins.args!r}: use KEY=VALUE"
                env[key] = value
    return env


def exec_form(args: str) -> list[str]:
    """The JSON array of CMD/ENTRYPOINT/HEALTHCHECK CMD (the exec form: no shell in between)."""
    import json

    parsed = json.loads(args)
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), args
    return parsed


def test_parser_joins_continuations_and_skips_comments() -> None:
    parsed = parse_dockerfile("FROM a:1\n# note\nENV A=1 \\\n    # inside\n    B=2\nRUN x \\\n && y\n")
    assert [(i.keyword, i.args) for i in parsed] == [("FROM", "a:1"), ("ENV", "A=1 B=2"), ("RUN", "x && y")]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_base_images_are_pinned(image: str) -> None:
    defaults = args_defaults(image)
    stages: set[str] = set()
    froms = [ins for ins in instructions(image) if ins.keyword == "FROM"]
    assert froms
    for ins in froms:
        words = ins.args.split()
        reference = substitute(words[0], defaults)
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
        if reference in stages:
            continue
        assert "$" not in reference, f"{image}: FROM {words[0]} has no default"
        name, _, tag = reference.rpartition(":")
        assert name and "/" not in tag, f"{image}: {reference} has no tag"
        assert tag != "latest" and not tag.startswith("latest"), f"{image}: {reference}"
        # An exact release: a version with at least major.minor.patch (python:3.11 alone would float).
        assert re.search(r"(^|[^\d])\d+\.\d+\.\d+", tag), f"{image}: {reference} is not an exact release"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_runs_unprivileged(image: str) -> None:
    stage = final_stage(image)
    users = [i for i, ins in enumerate(stage) if ins.keyword == "USER"]
    starts = [i for i, ins in enumerate(stage) if ins.keyword in ("CMD", "ENTRYPOINT")]
    assert users and starts, f"{image}: needs USER and CMD/ENTRYPOINT"
    assert max(users) < min(starts), f"{image}: USER comes after the command"
    user = stage[max(users)].args.split(":")[0]
    assert user not in ("root", "0"), f"{image} runs as root"
    # The user exists: created with a fixed uid (Kubernetes' runAsUser: 10001 names it).
    created = " ".join(ins.args for ins in stage if ins.keyword == "RUN")
    assert re.search(rf"useradd\b[^&]*--uid 10001\b[^&]*\b{user}\b", created), f"{image}: {user} is not created"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_healthcheck_runs_meshserve_health(image: str) -> None:
    [check] = [ins for ins in final_stage(image) if ins.keyword == "HEALTHCHECK"]
    options, _, command = check.args.partition(" CMD ")
    assert command, f"{image}: HEALTHCHECK without CMD"
    assert exec_form(command)[:2] == ["meshserve", "health"]
    assert "--timeout=" in options and "--interval=" in options


@pytest.mark.parametrize("image", DOCKERFILES)
def test_container_settings_and_ports(image: str) -> None:
    env = env_of(image)
    assert env["MESHSERVE_HOST"] == "0.0.0.0"
    assert env["MESHSERVE_METRICS_PORT"] == "9400"
    exposed = {int(p.split("/")[0]) for ins in final_stage(image) if ins.keyword == "EXPOSE" for p in ins.args.split()}
    assert 9400 in exposed
    if image == "services":
        assert {50051, 50052, 50054, 8000} <= exposed
        assert "MESHSERVE_PORT" not in env  # one image for three services: each container says its own
    else:
        assert env["MESHSERVE_PORT"] == "50053" and 50053 in exposed
        assert env["MESHSERVE_DEVICE"] == {"cpu": "cpu", "ascend": "npu", "cuda": "cuda"}[image]
    entrypoint = [exec_form(ins.args) for ins in final_stage(image) if ins.keyword == "ENTRYPOINT"]
    assert entrypoint, f"{image}: no ENTRYPOINT"
    # Exec form ending in `meshserve` (or exec'ing it), so SIGTERM reaches the service for its drain.
    assert entrypoint[-1][0] == "meshserve" or 'exec meshserve "$@"' in " ".join(entrypoint[-1])


def _pip_installs(image: str) -> list[str]:
    """Each `pip install ...` command of the image's RUN lines (pip or uv pip)."""
    commands = []
    for ins in instructions(image):
        if ins.keyword == "RUN":
            for part in re.split(r"&&|;", ins.args):
                if re.search(r"\bpip install\b", part):
                    commands.append(part.strip())
    return commands


def test_services_image_never_installs_torch() -> None:
    installs = _pip_installs("services")
    assert installs
    for command in installs:
        assert "torch" not in command, command
        assert "[worker" not in command and "[npu" not in command, command
    # What that install pulls in, transitively (as installed here): no torch, nor the worker's libraries.
    closure = _dependency_closure("meshserve")
    assert "grpcio" in closure and "tokenizers" in closure
    assert not closure & {"torch", "transformers", "accelerate", "safetensors"}, closure
    # The same walk does find torch behind the worker extra (accelerate needs it): the check can fail.
    assert "torch" in _dependency_closure("meshserve", ("worker",))


def _dependency_closure(package: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions `pip install PACKAGE[EXTRAS]` installs, from the installed packages' metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    pending: list[tuple[str, tuple[str, ...]]] = [(package, extras)]
    while pending:
        name, wanted = pending.pop()
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is not None and not any(marker.evaluate({"extra": e}) for e in ("", *wanted)):
                continue
            key = canonicalize_name(requirement.name)
            if key in seen:
                continue
            seen.add(key)
            try:
                metadata.distribution(requirement.name)
            except metadata.PackageNotFoundError:
                continue  # for another platform or Python
            pending.append((requirement.name, tuple(requirement.extras)))
    return seen


@pytest.mark.parametrize("image", WORKER_IMAGES)
def test_worker_images_pin_the_tested_torch(image: str) -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    tested = re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", makefile, re.MULTILINE)
    assert tested is not None
    assert args_defaults(image)["TORCH_VERSION"] == tested.group(1)
    torch_installs = [c for c in _pip_installs(image) if "torch==" in c]
    assert len(torch_installs) == 1, torch_installs
    [command] = torch_installs
    assert '"torch==${TORCH_VERSION}"' in command
    index = re.search(r"--index-url\s+\"?(\S+?)\"?(\s|$)", command)
    assert index is not None, f"{image}: torch must come from its platform's index"
    expected = {"cpu": "/whl/cpu", "ascend": "/whl/cpu", "cuda": "/whl/${CUDA_FLAVOUR}"}[image]
    assert index.group(1).startswith("https://download.pytorch.org") and index.group(1).endswith(expected)
    assert any('".[worker' in c and "-c constraints.txt" in c for c in _pip_installs(image)), image


def test_ascend_image_pairs_torch_npu_with_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    [npu] = project["optional-dependencies"]["npu"]
    assert npu == f"torch-npu=={args_defaults('ascend')['TORCH_VERSION']}"
    assert any(".[worker,npu]" in c for c in _pip_installs("ascend"))
    cann = args_defaults("ascend")["CANN_IMAGE"]
    # torch-npu 2.13.0 is TorchNPU 26.2.0, released for CANN 9.2.0 (see the Dockerfile's notes).
    assert re.fullmatch(r"quay\.io/ascend/cann:9\.2\.0-910b-ubuntu22\.04-py3\.11", cann), cann
    [entrypoint] = [exec_form(i.args) for i in final_stage("ascend") if i.keyword == "ENTRYPOINT"]
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in entrypoint[2]


def test_cpu_image_builds_the_native_kernels_as_its_user() -> None:
    stage = final_stage("cpu")
    user_at = max(i for i, ins in enumerate(stage) if ins.keyword == "USER")
    builds = [i for i, ins in enumerate(stage) if ins.keyword == "RUN" and "services.worker.kernels.loader" in ins.args]
    assert builds and builds[0] > user_at, "the kernel cache must be writable by the runtime user"
    assert any("g++" in ins.args for ins in stage if ins.keyword == "RUN"), "a first start on another ISA compiles"
    assert env_of("cpu")["MESHSERVE_KERNEL_CACHE_DIR"].startswith("/")


def test_constraints_pin_every_line() -> None:
    lines = [
        line.strip()
        for line in (DOCKER_DIR / "constraints.txt").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line), line
    names = [line.split("==")[0].lower() for line in lines]
    assert len(names) == len(set(names))
    assert "torch" not in names  # each Dockerfile takes torch from its own platform's index
    # What the worker imports at runtime is pinned.
    assert {"grpcio", "transformers", "safetensors", "tokenizers", "numpy", "protobuf"} <= set(names)


# --- the build context ------------------------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore pattern (Go's filepath.Match plus `**`) as a regex over a relative path."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out = out[:-2] + "(?:.*/)?"
                i += 1
            continue
        char = pattern[i]
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end
        else:
            out += re.escape(char)
        i += 1
    return re.compile(out)


@cache
def ignore_rules() -> tuple[tuple[bool, re.Pattern[str]], ...]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        rules.append((negate, _glob_regex(pattern.strip("/"))))
    return tuple(rules)


def excluded(path: str) -> bool:
    """Whether the build context leaves `path` out: the last rule matching it or a parent directory wins."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for negate, regex in ignore_rules():
        if any(regex.fullmatch(c) for c in candidates):
            result = not negate
    return result


def test_dockerignore_matcher() -> None:
    assert excluded(".venv/bin/python") and excluded("services/__pycache__/cli.cpython-311.pyc")
    assert excluded("deploy/k8s/base/worker.yaml")
    assert not excluded("deploy/docker/constraints.txt")
    assert not excluded("services/cli.py")


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (".venv/lib/x.py", ".git/HEAD", ".mypy_cache/x", ".ruff_cache/x", ".pytest_cache/x",
                 "services/worker/__pycache__/x.pyc", "meshserve.egg-info/PKG-INFO", "tests/conftest.py"):  # fmt: skip
        assert excluded(path), f"{path} would be sent to the build"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_copy_sources_exist_in_the_build_context(image: str) -> None:
    copies = [ins for ins in instructions(image) if ins.keyword == "COPY"]
    assert copies
    for ins in copies:
        words = ins.args.split()
        if any(w.startswith("--from=") for w in words):
            continue  # from another stage or image, not the context
        sources = [w for w in words[:-1] if not w.startswith("--")]
        assert sources, ins
        for source in sources:
            path = REPO / source
            assert path.exists(), f"{image} line {ins.line}: COPY {source} does not exist"
            assert not excluded(source), f"{image} line {ins.line}: .dockerignore leaves {source} out"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [p for p in files if not excluded(str(p.relative_to(REPO)))]
            assert kept, f"{image}: nothing of {source} reaches the build"
            # Source files the package needs (Python, protos, the kernels' C++) all reach it.
            for p in files:
                if p.suffix in (".py", ".proto", ".cpp", ".toml", ".md", ".txt", ".pyi"):
                    assert p in kept, f"{image}: .dockerignore drops {p.relative_to(REPO)}"
