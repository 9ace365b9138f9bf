"""veRL workers for diffusion RL: sampling, policy training and reward, as Ray actors."""
