"""The model: its files and config, kvloom's fused decoder and the stock one, rotary tables, paged attention
for transformers."""
