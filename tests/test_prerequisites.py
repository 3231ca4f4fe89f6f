"""The prerequisite helper of conftest: a missing tool skips on a developer's machine and fails
under CI=true, so a broken install cannot pass as a run of skips."""

import pytest
from conftest import missing_prerequisite, require, require_import


@pytest.mark.parametrize("ci", [None, "", "false", "1"])
def test_a_missing_prerequisite_skips_outside_ci(ci, monkeypatch):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="^sshd is not installed$"):
        missing_prerequisite("sshd is not installed")
    with pytest.raises(pytest.skip.Exception, match="no qemu"):
        require(False, "no qemu")
    with pytest.raises(pytest.skip.Exception, match="no_such_module_here"):
        require_import("no_such_module_here")
    require(True, "not raised")
    assert require_import("json").dumps([]) == "[]"


def test_a_missing_prerequisite_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"sshd is not installed \(CI=true: scripts/setup.sh"):
        missing_prerequisite("sshd is not installed")
    with pytest.raises(pytest.fail.Exception, match="no qemu"):
        require(False, "no qemu")
    with pytest.raises(pytest.fail.Exception, match="ray is not installed"):
        require_import("no_such_module_here", "ray is not installed")
    require(True, "not raised")
