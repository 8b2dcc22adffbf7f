"""dlrl: online RL for block-diffusion language models. See README.md."""
