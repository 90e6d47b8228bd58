"""The GPT and what computes with it: the network (gpt), attention masks and kernels (attention; its
masks stay out of compiled graphs through eager), the chunked soft-capped loss (loss), sampling
(generate), FLOPs and peak throughput (flops), dtype choices (precision, fp8), whether
torch.compile works here (compile_check) and its cache kept with the run (compile_cache).
"""
