"""server.recording.recording: recording finished samples into the feedback store, and the store's health.
"""
