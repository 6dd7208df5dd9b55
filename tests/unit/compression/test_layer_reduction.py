"""Layer reduction: a student from chosen teacher layers; distillation loss and its knobs."""
import pytest
import torch

from dsrun.compression import init_compression
from dsrun.compression.layer_reduction import Distiller, distillation_loss
from dsrun.models.gpt import GPT
from dsrun.utils.errors import UserError

SIZE = dict(vocab_size=32, block_size=8, n_head=2, n_embd=16)


def _config(**reduction) -> dict:
    base = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "transformer.h", "teacher_layer": [1, 3]}
    return {"compression_training": {"layer_reduction": {**base, **reduction}}}


def test_student_layers_come_from_the_chosen_teacher_layers():
    torch.manual_seed(0)
    teacher, student = GPT(n_layer=4, **SIZE), GPT(n_layer=2, **SIZE)
    init_compression(student, _config(other_module_name=["transformer.wte"]), teacher_model=teacher)
    for i, t in enumerate([1, 3]):
        for a, b in zip(student.transformer.h[i].parameters(), teacher.transformer.h[t].parameters()):
            assert torch.equal(a, b)
    assert torch.equal(student.transformer["wte"].weight, teacher.transformer["wte"].weight)
    assert not torch.equal(student.transformer["wpe"].weight, teacher.transformer["wpe"].weight)  # not listed


def test_without_a_teacher_the_model_keeps_its_own_chosen_layers():
    torch.manual_seed(0)
    model = GPT(n_layer=4, **SIZE)
    kept = [model.transformer.h[1], model.transformer.h[3]]
    init_compression(model, _config())
    assert list(model.transformer.h) == kept and model.config.n_layer == 2
    assert model(torch.randint(0, 32, (1, 8))).shape == (1, 8, 32)


def test_layer_reduction_errors_name_the_key():
    teacher = GPT(n_layer=4, **SIZE)
    with pytest.raises(UserError, match="keep_number_layer: is 2 but the student has 3"):
        init_compression(GPT(n_layer=3, **SIZE), _config(), teacher_model=teacher)
    with pytest.raises(UserError, match="other_module_name: 'nope' is not a module"):
        init_compression(GPT(n_layer=2, **SIZE), _config(other_module_name=["nope"]), teacher_model=teacher)
    with pytest.raises(UserError, match="'transformer.x' is not a module"):
        init_compression(GPT(n_layer=2, **SIZE), _config(module_name_prefix="transformer.x"), teacher_model=teacher)


def test_distillation_loss_is_zero_for_equal_logits_and_scales_with_temperature():
    s, t = torch.randn(6, 10), torch.randn(6, 10)
    assert distillation_loss(t, t).abs() < 1e-6
    ref = (torch.softmax(t.double() / 2, -1) * (torch.log_softmax(t.double() / 2, -1)
                                               - torch.log_softmax(s.double() / 2, -1))).sum(-1).mean() * 4
    assert abs(distillation_loss(s, t, temperature=2.0).item() - ref.item()) < 1e-5
    ignore = torch.tensor([False, True, False, False, False, True])
    assert abs(distillation_loss(s, t, ignore=ignore) - distillation_loss(s[~ignore], t[~ignore])) < 1e-6


def test_distiller_weight_and_temperature_change_the_loss():
    torch.manual_seed(0)
    student, teacher = GPT(n_layer=1, **SIZE), GPT(n_layer=2, **SIZE)
    with torch.no_grad():
        teacher.transformer["wte"].weight.mul_(100)  # confident teacher logits, far from the student's
    inputs, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    plain = student(inputs, targets)
    assert torch.equal(Distiller(teacher, weight=0.0).loss(student, inputs, targets), plain)
    one = Distiller(teacher, weight=1.0).loss(student, inputs, targets)
    two = Distiller(teacher, weight=2.0).loss(student, inputs, targets)
    assert torch.allclose(two - plain, 2 * (one - plain))
    assert not torch.allclose(Distiller(teacher, temperature=3.0).loss(student, inputs, targets), one, rtol=1e-3)
    assert one - plain > 0.1
