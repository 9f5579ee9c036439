"""AWS adapters: the only modules that talk to DynamoDB, S3 and SQS."""
