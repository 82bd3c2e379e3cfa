"""Mixture of experts with expert parallelism (Megatron-LM's MoE, names and flag meanings).

* ``config.py``            checks of the MoE config fields; which layers are MoE
* ``router.py``            ``TopKRouter``: scores, top-k (group-limited, sinkhorn), capacity dropping,
                           the load-balancing and z losses
* ``expert_bias.py``       aux-loss-free balancing: the expert bias's update after each optimizer
                           step (``update_expert_biases``)
* ``token_dispatcher.py``  permute / unpermute and the all-to-all dispatcher
* ``experts.py``           ``GroupedMLP``: this rank's experts, stacked (loop or grouped GEMM)
* ``moe_layer.py``         ``MoELayer`` (router -> dispatch -> experts -> combine [+ shared experts])
* ``expert_parallel.py``   the expert-parallel and expert-data-parallel layout (``ExpertParallel``)
* ``model_queries.py``     a built model's MoE layers, expert layout and expert parameters
* ``metrics.py``           aux losses and token loads, summed over steps and ranks for logging

Import the submodules directly; this package imports nothing on its own, so that
``transformer_config`` can use ``moe.config`` without a cycle.
"""
