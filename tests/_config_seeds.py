"""The seeds' YAML and log text, verbatim (``../shared/seeds/``), shared by the config tests.

The swap seed's four cases are complete YAML files; the recompute seed gives only
``recompute_config``. Its 48-layer example states the layout in prose (48 layers,
pipeline_stage 5, pp_interleave_num 2, offset [[0,1,1,1,1],[1,1,1,1,0]]), written
here where MindFormers reads it. The DeepSeek-V3 list is per stage of 16; the layout
is that of the DeepSeek-V3 pretrain YAML it is quoted from: pipeline_stage 16,
offset [1]*15 + [-1], 61 layers + 1 MTP layer = 62 (4 layers a stage, 2 in the last).
"""

SWAP_CASE_1 = """\
context:
  memory_optimize_level: "O0"
model:
  model_config:
    num_layers: 4
recompute_config:
  recompute: False
  select_recompute: False
  select_comm_recompute: False
swap_config:
  swap: True
  default_prefetch: 10
"""
SWAP_CASE_1_GREP = "attention.flash_attention"
SWAP_CASE_1_LOG = """\
-INFO - Set op_swap at layer 0: attention.flash_attention, value=10
-INFO - Set op_swap at layer 1: attention.flash_attention, value=10
-INFO - Set op_swap at layer 2: attention.flash_attention, value=10
-INFO - Set op_swap at layer 3: attention.flash_attention, value=10
"""

SWAP_CASE_2 = """\
context:
  memory_optimize_level: "O0"
model:
  model_config:
    num_layers: 4
recompute_config:
  recompute: False
  select_recompute: False
  select_comm_recompute: False
swap_config:
  swap: True
  layer_swap:
    - backward_prefetch: 20
      layers: [0,3]
"""
SWAP_CASE_2_GREP = "Set layer swap at"
SWAP_CASE_2_LOG = """\
-INFO - Set layer swap at layer 0 and value is: 20
-INFO - Set layer swap at layer 3 and value is: 20
"""

SWAP_CASE_3 = """\
context:
  memory_optimize_level: "O0"
model:
  model_config:
    num_layers: 4
recompute_config:
  recompute: False
  select_recompute: False
  select_comm_recompute: False
swap_config:
  swap: True
  op_swap:
    - op_name: 'attention'
      backward_prefetch: 20
      layers: [0,1,2]
    - op_name: 'attention'
      backward_prefetch: 10
      layers: [3]
    - op_name: 'feed_forward'
      backward_prefetch: 15
      layers: [1,2]
"""
SWAP_CASE_3_GREP = "Set op_swap at layer"
SWAP_CASE_3_LOG = """\
-INFO - Set op_swap at layer 0: .attention, value=20
-INFO - Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15
-INFO - Set op_swap at layer 2: .attention, value=20, .feed_forward, value=15
-INFO - Set op_swap at layer 3: .attention, value=10
"""

SWAP_CASE_4 = """\
context:
  memory_optimize_level: "O0"
model:
  model_config:
    num_layers: 4
recompute_config:
  recompute: False
  select_recompute:
    'feed_forward': [0,3]
  select_comm_recompute: False
swap_config:
  swap: True
  op_swap:
    - op_name: 'attention'
      backward_prefetch: 20
      layers: [0,1,2]
    - op_name: 'attention'
      backward_prefetch: 10
      layers: [3]
    - op_name: 'feed_forward'
      backward_prefetch: 15
      layers: [1,2]
"""
SWAP_CASE_4_GREP = "Set op_swap at layer"  # with -C 1
SWAP_CASE_4_LOG = """\
-INFO - Set select recompute at layer 0: feed_forward
-INFO - Set op_swap at layer 0: .attention, value=20
-INFO - Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15
-INFO - Set op_swap at layer 2: .attention, value=20, .feed_forward, value=15
-INFO - Set select recompute at layer 3: feed_forward
-INFO - Set op_swap at layer 3: .attention, value=10
"""

DEEPSEEK_V3 = """\
# recompute config
recompute_config:
  recompute: [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 2, 0]
  select_recompute: False
  parallel_optimizer_comm_recompute: True
  mp_comm_recompute: True
  recompute_slice_activation: True
"""
DEEPSEEK_V3_LAYOUT = """\
parallel_config:
  pipeline_stage: 16
model:
  model_config:
    num_layers: 62
    offset: [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1]
"""

LAYERS_48 = """\
# recompute config
recompute_config:
  recompute: [[2,1,0,0,0],[1,0,0,0,0]]
  select_recompute:
    'feed_forward\\.w1\\.activation\\.silu': True
    'feed_forward\\.mul': True
    'feed_forward\\.w1\\.matmul': [[1,0,0,0,0],[2,1,0,0,0]]
    'feed_forward\\.w3\\.matmul': [2,1,0,0,0]
  select_comm_recompute: ['ffn_norm\\.norm','attention_norm\\.norm']
"""
LAYERS_48_LAYOUT = """\
parallel_config:
  pipeline_stage: 5
model:
  model_config:
    num_layers: 48
    pp_interleave_num: 2
    offset: [[0,1,1,1,1],[1,1,1,1,0]]
"""
LAYERS_48_LOG = """\
INFO - Formative layer_recompute: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
INFO - Formative select_recompute: {'feed_forward\\.w1\\.activation\\.silu': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'feed_forward\\.mul': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'feed_forward\\.w1\\.matmul': [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]], 'feed_forward\\.w3\\.matmul': [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]}
INFO - Formative select_comm_recompute: {'ffn_norm\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'attention_norm\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}
"""
