"""examples/deq_transformer/train_pydoc.py: a resumed run continues exactly where the saved one was."""

import torch
import torch.nn.functional as F

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM
from examples.deq_transformer.train_pydoc import load_state, save_state


class _Tok:
    def save_pretrained(self, path):  # the state folder keeps the run's tokenizer
        (path / "tokenizer.json").write_text("{}")


def _setup():
    torch.manual_seed(0)
    config = DEQTransformerConfig(vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32, tgt_len=8,
                                  mem_len=8, dropout=0.2, pre_lnorm=True, on_nonconvergence="ignore",
                                  deq={"f_solver": "anderson", "f_max_iter": 6, "b_mode": "phantom",
                                       "b_mode_kwargs": {"k": 2, "tau": 0.6}})
    model = DEQTransformerForCausalLM(config).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched, x, y):
    out = model(x)  # dropout draws from torch's RNG: the saved state must restore it
    F.cross_entropy(out.logits.reshape(-1, 50), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    data = torch.randint(0, 50, (4, 2, 9), generator=torch.Generator().manual_seed(1))
    model, opt, sched = _setup()
    for i in range(2):
        _step(model, opt, sched, data[i, :, :-1], data[i, :, 1:])
    save_state(tmp_path, model, opt, sched, 1, [{"step": 1}], _Tok())
    for i in range(2, 4):
        _step(model, opt, sched, data[i, :, :-1], data[i, :, 1:])
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, sched = _setup()
    torch.manual_seed(123)  # a fresh process's RNG: load_state must put the saved one back
    first, log = load_state(tmp_path, model, opt, sched)
    assert first == 2 and log == [{"step": 1}] and (tmp_path / "tokenizer.json").is_file()
    for i in range(2, 4):
        _step(model, opt, sched, data[i, :, :-1], data[i, :, 1:])
    for k, v in model.state_dict().items():
        assert torch.equal(v, straight[k]), k
