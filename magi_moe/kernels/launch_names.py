"""The names of the fused path's launches: a :class:`~.plan.LaunchStep`'s ``kernel``, the Triton
kernel it runs. The planner (:mod:`.plan`, which hands them on), the launchers (:mod:`.fused`)
and the descriptor maker (:mod:`.descriptors`) all speak of steps by these names."""

SCHEDULE = "block_schedule_kernel"
EXPERT_MLP = "expert_mlp_tma_kernel"
GATHER_ROWS = "gather_rows_kernel"
GATE_UP = "gate_up_kernel"
GATE_UP_TMA = "gate_up_tma_kernel"
DOWN = "down_kernel"
DOWN_TMA = "down_tma_kernel"
TOPK_SUM = "topk_sum_kernel"
