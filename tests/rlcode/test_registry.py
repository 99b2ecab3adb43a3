"""The component registries: every built-in kind is found whichever module is imported first, and
no model module imports another to register it (each check starts a fresh interpreter)."""

import os
import subprocess
import sys
import textwrap

from flax import nnx

from rlcode.models import attention as attn_lib
from rlcode.models import mlp as mlp_lib
from rlcode.models import registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_fresh(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]


def test_mlp_alone_offers_both_kinds_and_does_not_import_moe():
    run_fresh("""
        import sys
        from flax import nnx
        from rlcode.models.mlp import MLP, make_mlp
        assert "rlcode.models.moe" not in sys.modules, "mlp imported moe"
        assert sorted(MLP) == ["dense", "moe"], sorted(MLP)
        moe_cls = MLP["moe"]
        assert moe_cls is sys.modules["rlcode.models.moe"].MoE
        from rlcode.models.transformer import ModelConfig, model_config
        cfg = ModelConfig.from_config(model_config(mlp={"kind": "moe", **sys.modules["rlcode.models.moe"].MOE_OPTIONS}))
        assert type(make_mlp(cfg, rngs=nnx.Rngs(0))) is moe_cls
    """)


def test_moe_first_then_mlp_no_cycle():
    run_fresh("""
        import sys
        import rlcode.models.registry
        models = ("rlcode.models.mlp", "rlcode.models.moe", "rlcode.models.attention")
        assert not [m for m in models if m in sys.modules], "the registries imported a model module"
        import rlcode.models.moe as moe
        assert "rlcode.models.mlp" not in sys.modules, "moe imported mlp"
        from rlcode.models.mlp import MLP, SwiGLU
        assert MLP["moe"] is moe.MoE and MLP["dense"] is SwiGLU
    """)


def test_builtin_kinds_resolve_to_modules_and_lookups_stay_lazy():
    assert mlp_lib.MLP is registry.MLP and attn_lib.ATTENTION is registry.ATTENTION
    for reg in (registry.MLP, registry.ATTENTION):
        for kind in reg:
            assert issubclass(reg[kind], nnx.Module), (reg.field, kind)
    assert attn_lib.ATTENTION["nsa"] is attn_lib.NSAAttention and mlp_lib.MLP["dense"] is mlp_lib.SwiGLU
    assert "moe" in registry.MLP and "nope" not in registry.MLP
