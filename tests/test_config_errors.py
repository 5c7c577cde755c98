"""Bad config input: one ConfigError naming the key path, the value and the accepted form."""

from __future__ import annotations

import argparse

import pytest

from adaptive_mem import ConfigError, plan_from_config


def cfg(n=4, *, pp=1, vv=1, offset=0, recompute=None, swap=None, **top):
    out = {"model": {"model_config": {"num_layers": n, "pp_interleave_num": vv, "offset": offset}},
           "parallel_config": {"pipeline_stage": pp}, **top}
    if recompute is not None:
        out["recompute_config"] = recompute
    if swap is not None:
        out["swap_config"] = swap
    return out


CASES = [
    # unknown keys, with the nearest valid key
    (cfg(recompute={"recompte": True}), ["recompute_config.recompte: unknown key", "did you mean 'recompute'?"]),
    (cfg(recompute={"select_recompute_typo": True}), ["did you mean 'select_recompute'?"]),
    (cfg(swap={"swap": True, "op_swaps": []}), ["swap_config.op_swaps: unknown key", "did you mean 'op_swap'?"]),
    (cfg(swap={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layer": [0]}]}),
     ["swap_config.layer_swap[0].layer: unknown key", "did you mean 'layers'?"]),
    ({"recompute_confg": {"recompute": True}}, ["recompute_confg: unknown key", "did you mean 'recompute_config'?"]),
    (cfg(recompute=None, parallel_config={"pipeline_stages": 2}),
     ["parallel_config.pipeline_stages: unknown key", "did you mean 'pipeline_stage'?"]),
    ({"recompute": True}, ["recompute: a recompute_config key at the top level", "nested under recompute_config"]),
    # wrong types
    (cfg(recompute={"recompute": "yes"}), ["recompute_config.recompute='yes'", "expected True/False"]),
    (cfg(recompute={"recompute": [1.5]}), ["recompute_config.recompute", "expected"]),
    (cfg(recompute={"recompute": [-1]}), ["recompute_config.recompute[0]=-1", "layer count >= 0"]),
    (cfg(recompute={"mp_comm_recompute": "on"}), ["recompute_config.mp_comm_recompute='on'", "True or False"]),
    (cfg(swap={"swap": "yes"}), ["swap_config.swap='yes'", "True or False"]),
    (cfg(swap={"swap": True, "default_prefetch": -2}), ["swap_config.default_prefetch=-2", "integer >= 0"]),
    (cfg(swap={"swap": True, "op_swap": {"op_name": "attention"}}), ["swap_config.op_swap=", "expected a list of"]),
    (cfg(swap={"swap": True, "op_swap": [{"op_name": "attention", "layers": [0]}]}),
     ["swap_config.op_swap[0].backward_prefetch: missing"]),
    (cfg(recompute={"select_recompute": {"feed_forward": [[1]]}}, pp=1, swap={"swap": True, "op_swap": []}),
     ["recompute_config.select_recompute.feed_forward[0]=[1]", "expected a layer index"]),
    ("not-a-file.yaml", ["config file 'not-a-file.yaml': cannot read"]),
    (42, ["config=42: expected a path to a MindFormers YAML"]),
    # stage lists vs pipeline_stage, offsets
    (cfg(8, pp=2, recompute={"recompute": [1, 1, 1]}),
     ["recompute_config.recompute=[1, 1, 1]: 3 stage counts but pipeline_stage=2"]),
    (cfg(8, pp=2, vv=2, recompute={"recompute": [[1, 1]]}), ["1 rows but pp_interleave_num=2"]),
    (cfg(8, pp=2, offset=[1, 0]), ["model.model_config.offset=[1, 0]: offsets sum to 1; expected them to sum to 0"]),
    (cfg(8, pp=2, offset=[0, 0, 0]), ["model.model_config.offset=[0, 0, 0]: 3 entries but "
                                      "parallel_config.pipeline_stage=2"]),
    (cfg(4, pp=2, offset=[3, -3]), ["model.model_config.offset=[3, -3]: chunk [0][1] gets -1 layers"]),
    # regexes
    (cfg(recompute={"select_recompute": {r"feed_forward\.w9": True}}),
     [r"recompute_config.select_recompute.feed_forward\.w9='feed_forward\\.w9': matches no op of a layer",
      "such as attention_norm.norm, attention.wq.matmul"]),
    (cfg(recompute={"select_comm_recompute": ["("]}), ["not a valid regular expression"]),
    (cfg(swap={"swap": True, "op_swap": [{"op_name": "mlp", "backward_prefetch": 1, "layers": [0]}]}),
     ["swap_config.op_swap[0].op_name='mlp': matches no op of a layer"]),
    # indices out of range
    (cfg(4, swap={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 4]}]}),
     ["swap_config.layer_swap[0].layers[1]=4: layer index out of range; expected 0..3"]),
    (cfg(4, recompute={"recompute": [7]}, swap={"swap": True, "op_swap": []}),
     ["recompute_config.recompute[0]=7: layer index out of range; expected 0..3"]),
    (cfg(4, recompute={"recompute": [[1]]}, swap={"swap": True, "op_swap": []}),
     ["recompute_config.recompute[0]=[1]: expected a layer index", "pipeline-agnostic"]),
    # layer counts
    ({"recompute_config": {"recompute": True}}, ["model.model_config.num_layers: missing"]),
    (cfg(0), ["model.model_config.num_layers=0: expected an integer >= 1"]),
    (cfg(recompute={"recompute": ["feed_forward"]}), ["op names belong in select_recompute"]),
]


@pytest.mark.parametrize("config,parts", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_config_gives_one_clear_error(config, parts):
    with pytest.raises(ConfigError) as info:
        plan_from_config(config, model=None)
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


def test_invalid_yaml_file_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("recompute_config:\n  recompute: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml': not valid YAML at line"):
        plan_from_config(str(path), model=None, num_layers=2)


MEGATRON_CASES = [
    (["--recompute-activations", "--recompute-method", "uniform"],
     ["--recompute-method=uniform: recompute method is not yet supported for selective recomputing granularity"]),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], ["not yet supported for selective"]),
    (["--recompute-granularity", "full"], ["--recompute-granularity=full: no --recompute-method",
                                           "expected --recompute-method uniform or block"]),
    (["--recompute-method", "block"], ["--recompute-method=block: has no effect without a granularity"]),
    (["--recompute-granularity", "selective", "--distribute-saved-activations"],
     ["--distribute-saved-activations: distributed recompute activations is only applicable to full"]),
    (["--recompute-granularity", "full", "--distribute-saved-activations"],
     ["--distribute-saved-activations: for distributed recompute activations to work you need a recompute method"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     ["--recompute-num-layers=0: expected an integer >= 1"]),
    (["--recompute-granularity", "partial"], ["--recompute-granularity", "partial"]),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--pipeline-model-parallel-size", "3"],
     ["--pipeline-model-parallel-size=3: does not divide the 4 layers"]),
    (["--recompute-everything"], ["Megatron flag '--recompute-everything': unknown"]),
]


@pytest.mark.parametrize("flags,parts", MEGATRON_CASES, ids=[str(i) for i in range(len(MEGATRON_CASES))])
def test_bad_megatron_flags(flags, parts):
    with pytest.raises(ConfigError) as info:
        plan_from_config(flags, model=None, num_layers=4)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


def test_megatron_namespace_with_wrong_values():
    ns = argparse.Namespace(recompute_granularity="full", recompute_method="diagonal")
    with pytest.raises(ConfigError, match=r"--recompute-method='diagonal': expected one of uniform, block"):
        plan_from_config(ns, model=None, num_layers=4)
