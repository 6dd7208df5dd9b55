"""What a run trains, composed by the worker: the dense GPT, the pipelined GPT, data-efficiency runs."""
