"""DeepSpeed's checkpoint key and file names (``deepspeed.checkpoint.constants``): the strings DeepSpeed's files,
its universal checkpoints and the model's ``universal_checkpoint_info`` use, so code written against DeepSpeed
reads the same keys from a dsrun checkpoint. dsrun's own readers and writers spell the file names in
:mod:`dsrun.checkpoint.layout`."""

# optimizer states
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"

# module states
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"

# file names
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

# the parallel degrees a checkpoint was saved at
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
DS_VERSION = "ds_version"

# universal checkpoints: the model's universal_checkpoint_info and the per-parameter files
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
SUB_PARAMS_SHAPE = "sub_params_shape"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"  # UCP 0.4: each sub-parameter's width on each TP rank
# the attribute an AutoTP parameter carries its split in (dsrun.checkpoint.autotp_meta), and the model-level
# patterns of parameters whose split the universal conversion cannot undo (with the reason)
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
EP_IS_EXPERT_PARAM = "is_expert_param"
EP_NUM_EXPERTS = "ep_num_experts"
EXPERT_PARAMETER_PATTERNS = "expert_parameter_patterns"

# DeepSpeed's AutoEP: the model states' record of its expert layers
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE)

# AutoEP folded over AutoTP: the record of the rank layout a checkpoint was written under (checkpoint.autoep_universal)
FOLDING_METADATA_KEY = "folding"
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"
