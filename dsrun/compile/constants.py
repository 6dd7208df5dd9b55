"""DeepCompile's constants (DeepSpeed's ``deepspeed.compile.constants``): the tags AutoSP finds its inputs by
(``tensor.tag``, set by :func:`dsrun.compile.autosp.prepare_autosp_inputs`)."""

AUTOSP_INPUT_ID_KEY = "input_id"
AUTOSP_LABEL_ID_KEY = "label_id"
AUTOSP_POSITION_ID_KEY = "position_id"
