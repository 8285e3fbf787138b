"""Start-up stays light: the CLI's help and the top-level package load no heavy library."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "timm", "matplotlib", "backpack", "scipy", "sklearn", "torchvision")


def loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}; import sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {m.split(".")[0] for m in out}


@pytest.mark.parametrize(
    "code",
    [
        "import bayescli",
        "import bayescli.cli.app",
        "from bayescli.cli.app import app; import typer.main; typer.main.get_command(app)",
    ],
)
def test_no_heavy_imports_at_start_up(code):
    assert not set(HEAVY) & loaded_after(code)


def test_lazy_top_level_exports_resolve():
    import bayescli

    assert set(bayescli.__all__) <= set(dir(bayescli))
    for name in bayescli.__all__:
        assert getattr(bayescli, name) is not None
    with pytest.raises(AttributeError):
        bayescli.no_such_thing  # noqa: B018
