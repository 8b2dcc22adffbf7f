"""dlrl trainer: online RL loop (TraceRL / DiPO), objectives, advantages, rewards, data."""
