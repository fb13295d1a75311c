"""KV tiers under the paged KV cache (issue 71): a node-shared host tier and a disk tier of full blocks, so a
prefix that left a replica's pool, or was computed by another replica of the node, is copied back instead of
computed. block_store.py is one tier (a directory of verified block files), tiers.py the engine's view of them,
tier_io.py the worker thread that reads and writes them beside the steps, recent_hashes.py what a replica tells the
router its node's tiers hold."""
