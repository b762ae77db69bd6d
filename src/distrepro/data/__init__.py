"""Raw image datasets in the ImageNet layout -> ImageNet-schema TFRecords."""
