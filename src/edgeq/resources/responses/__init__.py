"""OpenAI's Responses on the queue: its events, the stored responses, their follower."""
