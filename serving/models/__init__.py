"""Model code for serving: DeepSeek-V3 (MLA + dense/MoE MLP) and its layers. The package imports nothing: the
server process imports some of its light modules without the model's (torch's attention biases import
torch._dynamo, about a second)."""
