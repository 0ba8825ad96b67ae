"""View models: the plain data each widget draws (the sharding explorer's layout and its cost, a KV cache's
fill, expert dispatch, the parameter tree, the attention lab's comparisons, a token stream). No widget code.
"""
