"""A 213M-parameter DeepSeek-V3 decoder (4 dense layers, hidden 1536, 16 heads of DeepSeek-V3's head sizes: qk 192 =
nope 128 + rope 64 interleaved, v 128, kv_lora_rank 512, q_lora_rank 768; vocab 32000), random weights, saved as a
checkpoint and exported whole by torch.onnx (eager attention, batch fixed at 1, its cache MLA's latent: each layer's
compressed kv and rope key), as tests/fixtures/exported/make_mla.py makes the tiny fixture. Run from the repository
root in the test venv (transformers 5.24):

    python measurements/mla_whole/make_big.py OUT     # OUT/ck (checkpoint), OUT/model.onnx (about 850 MB)
"""

import sys
from pathlib import Path

import torch
import transformers as t
from torch.export import Dim

sys.path[:0] = ["tests/fixtures/exported", "tests/fixtures"]
import make as mk  # noqa: E402

C = dict(hidden_size=1536, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=4, intermediate_size=4096,
         vocab_size=32000, first_k_dense_replace=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
         v_head_dim=128, q_lora_rank=768, rope_interleave=True, attention_bias=False, max_position_embeddings=256)
out = Path(sys.argv[1])
torch.manual_seed(1)
ck = out / "ck"
t.DeepseekV3ForCausalLM(t.DeepseekV3Config(**C)).eval().save_pretrained(ck)
model = t.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="eager").eval()
mk.flat_decoder(model, True)
B, S, P = 1, 3, 4
ids = torch.randint(3, 32000, (B, S))
am = torch.ones(B, S + P, dtype=torch.int64)
pos = torch.arange(P, P + S)[None]
past = []
for _ in range(4):
    past += [torch.randn(B, 1, P, 512), torch.randn(B, 1, P, 64)]
ins, outs = mk.decoder_io(model.config, True)
seq = Dim("sequence_length")
ds = {"input_ids": {1: seq}, "position_ids": {1: seq}, "attention_mask": {1: Dim("total_sequence_length")},
      "past": tuple({2: Dim("past_sequence_length")} for _ in past)}
torch.onnx.export(model, (ids, am, pos, *past), dynamo=True, input_names=ins, output_names=outs,
                  dynamic_shapes=ds).save(str(out / "model.onnx"))
