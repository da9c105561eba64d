"""Plugins: entry-point discovery, the allow-list, broken plugins, hook docs, import hygiene."""
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sdk import UnknownModelError, build_megakernel, hookspecs, plugins

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-install the dummy and the broken third-party plugin packages into a private folder."""
    site = tmp_path_factory.mktemp("site")
    for pkg in ("dummy_plugin", "broken_plugin"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(PLUGINS / pkg)], check=True)
    return site


def megakernel(site, *args, env=None):
    """Run the CLI in a fresh interpreter that sees the installed plugins."""
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), **(env or {}))
    if env is None:
        e.pop(plugins.ALLOW_ENV, None)
    return subprocess.run([sys.executable, "-m", "sdk.cli", *args], capture_output=True, text=True, env=e)


def test_in_tree_models_register_through_entry_points():
    from importlib import metadata
    names = {ep.name for ep in metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)}
    assert {"kimi_k3", "deepseek_v41_flash", "glm_53"} <= names
    assert {"kimi_k3", "deepseek_v41_flash", "glm_53"} <= set(plugins.models())
    assert plugins.get_model("kimi_k3").plugin == "kimi_k3"


def test_third_party_plugin_is_discovered(plugin_site):
    r = megakernel(plugin_site, "models")
    assert r.returncode == 0, r.stderr
    assert "dummy" in r.stdout and "test plugin model" in r.stdout
    assert "kimi_k3" in r.stdout


def test_broken_plugin_is_reported_not_fatal(plugin_site):
    r = megakernel(plugin_site, "models")
    assert r.returncode == 0
    assert "plugin 'broken'" in r.stdout and "broken on purpose" in r.stdout
    assert "dummy" in r.stdout  # the others still load


def test_allow_list_excludes_plugins(plugin_site):
    r = megakernel(plugin_site, "models", env={plugins.ALLOW_ENV: "kimi_k3,glm_53"})
    assert r.returncode == 0, r.stderr
    assert "kimi_k3" in r.stdout and "glm_53" in r.stdout
    assert "dummy" not in r.stdout and "broken" not in r.stdout and "deepseek_v41_flash" not in r.stdout


def test_third_party_model_builds_and_decodes(plugin_site):
    code = ("from sdk import build_megakernel\nfrom sdk.reference.model import random_weights\n"
            "mk = build_megakernel('dummy', config='tiny')\nmk.load_weights(random_weights(mk.spec))\n"
            "import torch\nout = mk.generate(torch.tensor([[1, 2, 3]]), 4)\nprint(out.shape)")
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_site), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 7])" in r.stdout


def test_plugins_load_lazily_and_once():
    code = ("import sdk, sys\nfrom sdk import plugins\nassert plugins._state is None\n"
            "assert 'models.kimi_k3' not in sys.modules\nassert 'cutlass' not in sys.modules\n"
            "assert 'transformers' not in sys.modules\n"
            "plugins.models(); s = plugins.state(); plugins.models(); assert plugins.state() is s\n"
            "import torch\nassert not torch.cuda.is_initialized()\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_unknown_model_lists_registered():
    with pytest.raises(UnknownModelError) as exc:
        build_megakernel("no_such_model")
    assert "no_such_model" in str(exc.value)
    for name in ("kimi_k3", "deepseek_v41_flash", "glm_53"):
        assert name in str(exc.value)


def test_docs_list_every_hook_with_its_signature():
    doc = (ROOT / "docs" / "plugins.md").read_text()
    hooks = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(f, hookspecs.PROJECT + "_spec")]
    assert {"register_models", "register_blocks", "register_backends"} <= set(hooks)
    for name in hooks:
        sig = f"{name}{inspect.signature(getattr(hookspecs, name))}"
        assert re.search(re.escape(sig), doc), f"docs/plugins.md does not document `{sig}`"
