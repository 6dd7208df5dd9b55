"""Random-LTD (DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing``): the layer wrapper, its schedule,
and the helpers that convert a model's layers and strip the wrapper from state dicts."""
from dsrun.data_efficiency.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.data_efficiency.data_routing.helper import convert_to_random_ltd, remove_random_ltd_state_dict, save_without_random_ltd
from dsrun.data_efficiency.data_routing.scheduler import RandomLTDScheduler

__all__ = ["RandomLTDScheduler", "RandomLayerTokenDrop", "convert_to_random_ltd", "remove_random_ltd_state_dict",
           "save_without_random_ltd"]
