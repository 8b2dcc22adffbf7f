"""The RL mathematics of a step: the learner (losses, mini-batches), objectives, advantages,
train-serve correction, replay rows, the value model, this rank's rollouts."""
