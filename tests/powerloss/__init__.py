"""A crash-consistency test layer: a FUSE passthrough that records every filesystem operation (recorder.py), a
persistence model that turns the record into the states a power cut could leave (model.py), and the campaign that
resumes training from each of them (campaign.py). See docs/reliability.md, "Power loss"."""
