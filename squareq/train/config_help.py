"""The one-line help of every `squareq train` key: `squareq train --help`, docs/cli.md and the commands that share a
key's flag (`squareq cache`, `squareq sample`) show these texts, and the CLI makes a flag of every key in it."""

HELP = {
    "model": "The pipeline with the VAE and text encoders: a diffusers folder or a Hugging Face Hub ID (default: what "
             "the slab records, the encoders it was compiled with).",
    "revision": "The branch, tag or commit of a Hub ID given as model.",
    "clip_l": "CLIP-L text encoder as a single file (ComfyUI's clip_l.safetensors), in place of the pipeline's, whose "
              "configs and tokenizers still come from the pipeline (for a FLUX.1 file with no pipeline: "
              "black-forest-labs/FLUX.1-dev's, a few MB).",
    "clip_g": "CLIP-G text encoder as a single file (SD3/SDXL's second CLIP), in place of the pipeline's.",
    "t5": "T5 text encoder as a single file (ComfyUI's t5xxl_fp16.safetensors, or t5xxl_fp8_e4m3fn.safetensors, "
          "upcast on load), in place of the pipeline's.",
    "vae": "VAE as a single file (BFL's ae.safetensors for FLUX.1), in place of the pipeline's.",
    "cache_dir": "Where cached latents and text embeddings go (default: OUT/cache).",
    "rank": "LoRA rank.",
    "alpha": "LoRA alpha; the update is scaled by alpha/rank (default: alpha = rank).",
    "targets": "Comma-separated layer name patterns for LoRA, matched like PEFT target_modules (default: the "
               "family's; FLUX.1: every attention and MLP linear of both streams, as kohya's FLUX default; other "
               "families: to_q,to_k,to_v,to_out.0).",
    "use_dora": "Train DoRA (weight-decomposed LoRA: a trained magnitude per output row) through PEFT's layers; "
                "written in the diffusers file only.",
    "use_rslora": "Scale the LoRA by alpha/sqrt(rank) instead of alpha/rank (rank-stabilised LoRA, through PEFT's "
                  "layers).",
    "lora_dropout": "Dropout on the LoRA's input while training (through PEFT's layers), e.g. 0.1.",
    "lora_type": "The adapter: lora; lokr (LyCORIS' Kronecker-product adapter, rank is its low-rank factor's rank) "
                 "or loha (LyCORIS' Hadamard product of two rank-r pairs), both through PEFT's layers and written "
                 "as a PEFT adapter folder (OUT/<title>_peft, PeftModel.from_pretrained loads it); ai-toolkit's "
                 "network type, kohya's LyCORIS algo.",
    "lokr_factor": "LoKr's decompose factor (ai-toolkit's lokr_factor, PEFT's decompose_factor): -1 splits each "
                   "layer's sides as evenly as they factor, N makes the Kronecker product's first factor at most "
                   "N x N.",
    "lr": "Learning rate.",
    "optimizer": "adamw, adamw8bit (needs bitsandbytes), prodigy (needs prodigyopt; use lr 1.0) or adafactor.",
    "weight_decay": "AdamW weight decay.",
    "schedule": "Learning-rate schedule after --warmup, by diffusers' names: constant (constant_with_warmup is the "
                "same), linear (to 0), cosine (a half cosine to 0), cosine_with_restarts (--schedule-cycles half "
                "cosines) or polynomial (to 0 with --schedule-power).",
    "schedule_cycles": "cosine_with_restarts: how many times the learning rate falls to 0 and starts again (kohya's "
                       "lr_scheduler_num_cycles).",
    "schedule_power": "polynomial: the power of the decay, 1 is linear (kohya's lr_scheduler_power).",
    "warmup": "Steps of linear learning-rate warm-up.",
    "steps": "Optimizer steps to train.",
    "epochs": "Passes over the data; when given, decides the length instead of --steps.",
    "batch_size": "Images per step (per GPU).",
    "grad_accum": "Batches whose gradients are summed before each optimizer step.",
    "max_grad_norm": "Clip the LoRA gradient norm to this (0: no clipping).",
    "ema_decay": "Keep an exponential moving average of the LoRA weights with this decay, e.g. 0.999, and write it as "
                 "the final LoRA (0: off).",
    "resolution": "Training side in pixels; images go to aspect-ratio buckets of about resolution² pixels. Several, "
                  "comma-separated (512,768,1024), train every image at each.",
    "caption_dropout": "Probability of training a step with an empty caption (the trigger word is kept).",
    "trigger": "Trigger word put in front of every caption, or in place of [trigger] where a caption has it.",
    "shuffle_caption": "Shuffle each caption's comma-separated tags (kohya's shuffle_caption): caption_orders shuffles "
                       "of every caption are encoded into the cache, and each epoch trains an image with the next.",
    "keep_tokens": "With shuffle_caption, the leading tags that stay in place (the trigger word stays first "
                   "without being counted).",
    "caption_orders": "With shuffle_caption, how many shuffled orders of each caption are encoded (more orders, more "
                      "variety and more cache space: 8 MB each with FLUX's 512 T5 tokens).",
    "caption_ext": "Extension of the caption files next to the images: .txt, or e.g. .caption (kohya's).",
    "flip_aug": "Also cache each training image's horizontally flipped latents and train on them half of the time "
                "(seeded per image and epoch, so a resumed run makes the same choices); kohya's flip_aug. Leave it "
                "off for subjects whose sides differ (text, logos, asymmetric faces).",
    "masked_loss": "Weight each training image's loss by a mask (kohya's masked_loss): white or opaque trains, black "
                   "or transparent is ignored. The masks come from alpha_mask or mask_dir.",
    "alpha_mask": "With masked_loss: each image's alpha channel is its mask (kohya's alpha_mask).",
    "mask_dir": "With masked_loss: a folder of grey-level masks named like the training images (same path below it, "
                "any image extension; kohya's conditioning_data_dir, ai-toolkit's mask_path). An image without one "
                "trains unmasked, with a warning.",
    "control_dir": "Edit pairs (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2's reference images): the folder of control "
                   "images, each named like its training image (any image extension, or numbered name_0, name_1 for "
                   "several; musubi-tuner's control_directory), or several folders, comma-separated (ai-toolkit's "
                   "control_path list). The captions are the edit instructions (docs/train.md, \"Edit pairs\").",
    "control_resolution": "Edit pairs: bring each control image to this area instead of its target's bucket, [width, "
                          "height] or one side (musubi-tuner's control_resolution); with no_resize_control, the most "
                          "a control keeps.",
    "no_resize_control": "Edit pairs: keep each control image at its own size, center-cropped to a multiple of 16 "
                         "(musubi-tuner's no_resize_control). FLUX.2 does so by default, up to 1024² (Flux2Pipeline's "
                         "rule), where neither key is set.",
    "no_upscale": "Train an image smaller than its bucket at its own size (in steps of 64, center-cropped) instead "
                  "of enlarging it, like kohya's --bucket_no_upscale.",
    "reg_data": "A folder of regularisation (prior) images with captions, read like --data (kohya's reg_data_dir): "
                "each epoch mixes in as many of their entries as it has training entries, their loss weighted by "
                "prior_loss_weight.",
    "prior_loss_weight": "Weight of the regularisation images' loss against the training images' (kohya's "
                         "prior_loss_weight).",
    "num_repeats": "Train each image (or clip window) this many times an epoch, times its kohya repeat folder's "
                   "count (musubi-tuner's and kohya's num_repeats; default 1).",
    "dataset_config": "A TOML file of [[datasets]] tables, kohya's and musubi-tuner's dataset config: each table its "
                      "own folder, resolution, batch size, num_repeats, caption extension and frame keys, with "
                      "[general] defaults (docs/train.md, \"Several datasets\").",
    "datasets": "[[datasets]] tables in the --config file (as in a dataset_config file); a file's, not a flag.",
    "offload_activations": "Keep the checkpointed block inputs in host memory, copied out and back while the blocks "
                           "compute: auto (where vram_budget cannot hold them with the rest: long video windows), "
                           "on or off.",
    "validation_data": "A folder of held-out images with captions (read like --data) whose loss is measured during "
                       "training at fixed timesteps and noise.",
    "validation_split": "Hold this fraction of --data's images out of training and measure their loss instead (kohya's "
                        "validation_split), e.g. 0.1.",
    "validate_every": "Measure the validation loss every N steps (0: with every checkpoint); always at step 0 and "
                      "at the end.",
    "seed": "Seed for LoRA init, batch order, noise and timesteps.",
    "timestep_sampling": "shift, logit_normal, uniform, or flux_shift (FLUX.1's resolution-dependent shift of a "
                         "logit-normal draw, kohya's flux_shift).",
    "loss_weighting": "Per-sample loss weights of flow matching: none, sigma_sqrt or cosmap (diffusers' SD3/FLUX "
                      "schemes).",
    "shift": "Time shift for timestep_sampling = shift.",
    "guidance": "Embedded guidance value given to guidance-distilled models during training.",
    "max_sequence_length": "Text-encoder tokens per caption (T5, UMT5, Mistral, Qwen, LLaMA); SD 1.5/SDXL's CLIP "
                           "always takes 77.",
    "save_every": "Write a checkpoint every N steps (0: only at the end).",
    "keep_last": "Checkpoints to keep.",
    "sample_every": "Sample images every N steps (0: never).",
    "sample_prompts": "A prompt to sample (repeat the flag for several), with kohya's per-prompt options if wanted "
                      "(\"a fox --w 768 --h 1024 --s 28 --g 3.5 --d 7 --n blurry --l 4\"); in a config file also the "
                      "path of a prompt file, one prompt a line (kohya's sample_prompts).",
    "sample_seed": "Seed for sample images.",
    "sample_steps": "Denoising steps per sample image, 1 to 1000.",
    "sample_guidance": "Guidance scale for sample images.",
    "sample_prior": "Würstchen: the prior's pipeline folder or Hub ID (warp-ai/wuerstchen-prior) for sample images: "
                    "its text encoder and scheduler beside a prior slab being trained, or the whole prior beside a "
                    "decoder slab.",
    "sample_decoder": "Würstchen: the decoder's pipeline folder or Hub ID (warp-ai/wuerstchen) for sample images: its "
                      "text encoder, scheduler and VQGAN beside a decoder slab being trained, or the whole decoder "
                      "beside a prior slab.",
    "log": "Metrics: jsonl (always written), tensorboard, or wandb (Weights & Biases; the wandb extra; "
           "WANDB_MODE=offline logs without an account, a resumed run continues the same W&B run).",
    "wandb_project": "The Weights & Biases project of --log wandb (kohya's log_tracker_name).",
    "resume": "Continue from a checkpoint: latest, or a checkpoint folder.",
    "nan_patience": "Stop after this many steps in a row with NaN/Inf losses or gradients.",
    "prefetch": "Block slots on the GPU (the runtime's ring size): auto (measure the second step and add slots until "
                "the block copies hide behind compute, as squareq sample does; within vram_budget when set), or a "
                "whole number.",
    "resident_blocks": "Blocks kept on the GPU for the whole run after the second step, the ones whose copies cost the "
                       "step most first (the inverse of kohya/musubi's blocks_to_swap): 0 (stream every block, the "
                       "least memory), a count, or auto (as many as shorten the step, within vram_budget when set, "
                       "else what the GPU has free less a margin). Results do not change, only speed and memory.",
    "dtype": "The activations' 16-bit type (kohya's mixed_precision): bf16; fp16, for GPUs without bf16 (T4, V100, "
             "RTX 20xx: the base in fp16, the LoRA in fp32, the loss scaled as torch.amp.GradScaler does, no FP8); "
             "or auto: fp16 on GPUs older than Ampere, bf16 elsewhere. The run says when it chose fp16 and why.",
    "compute": "The frozen base layers' arithmetic: bf16; fp8 (E4M3 forward and recompute with per-token and "
               "per-channel scales on GPUs with FP8 tensor cores, Ada and Hopper; input gradients and the LoRA stay "
               "bf16/fp32); or auto: fp8 on GPUs with FP8 tensor cores, bf16 elsewhere. "
               "docs/tuning.md says when to choose which.",
    "host": "Where block blobs wait: auto (pinned when they fit within host_budget with the rest of the run, else "
            "disk; the run says which), pinned (RAM; shared by the ranks of a host when several run), shared (one "
            "RAM copy per host, in /dev/shm), or disk.",
    "cuda_graphs": "Capture each streamed block's forward and its recompute + backward as CUDA graphs once (the first "
                   "steps run eagerly while they are captured) and replay them, which takes the host's kernel launches "
                   "out of the step: auto (on with a CUDA GPU, unless lora_dropout is set), on, or off. "
                   "docs/tuning.md says when it pays.",
    "compile": "Run each block's forward under torch.compile (one compiled forward per block kind; the quantized "
               "layers keep their own kernels), which fuses the norms, modulation, rotary embedding and activations "
               "between them: auto (on for FLUX.1 with CUDA GPUs of compute capability 9.0 and up, where it measured "
               "faster; the run says why), on, or off. The first steps compile, about a minute for FLUX.1; "
               "docs/tuning.md.",
    "attention": "Which attention kernels the blocks prefer: auto (cuDNN's first on CUDA GPUs of compute capability "
                 "9.0 and up for heads of 128, FLUX.1's, where they measured twice as fast as flash; torch's order "
                 "elsewhere), cudnn (first on any CUDA GPU), or default (torch's order: flash first, though torch 2.11 "
                 "puts cuDNN first itself on Hopper with cuDNN 9.9 and up). A cuDNN "
                 "failure turns it off for the run and redoes the step; docs/tuning.md.",
    "target_frames": "Clips: the frame counts of the windows cut from each clip, e.g. [1, 25, 45] (musubi-tuner's "
                     "key), rounded down to what the family's VAE takes (1 + 4k for Wan and HunyuanVideo, 1 + 8k for "
                     "LTX-Video); images are one-frame samples.",
    "frame_extraction": "Clips: how windows are cut: head (the first N frames), chunk (consecutive windows of N), "
                        "slide (a window every frame_stride frames), uniform (frame_sample windows spread evenly), "
                        "full (the whole clip up to max_frames).",
    "frame_stride": "Clips: frames between the starts of frame_extraction = slide's windows.",
    "frame_sample": "Clips: how many windows frame_extraction = uniform spreads over each clip.",
    "max_frames": "Clips: the most frames frame_extraction = full takes from a clip.",
    "source_fps": "Clips: the clips' frame rate, e.g. 30.0; frames are dropped to the family's rate (16 for Wan, 24 "
                  "for HunyuanVideo, 25 for LTX-Video). Unset: every frame is used.",
    "vram_budget": "Refuse to start if the expected peak GPU memory exceeds this, e.g. 12GB.",
    "host_budget": "Host memory (RAM) the run may hold, e.g. 24GB, or auto: what the machine has available, less 10% "
                   "or 2 GB. The plan keeps within it what it can (the slab's blocks and a streamed text encoder "
                   "pinned whole, else read from their files through a few page-locked blocks) and refuses, before "
                   "any work, a run that cannot fit, naming the smallest budget that would.",
    "save_format": "LoRA files to write: diffusers (pytorch_lora_weights.safetensors), kohya (OUT/<title>_kohya"
                   ".safetensors, the family's kohya/ComfyUI layout at the trained strength; LyCORIS's for lokr and "
                   "loha), or both, comma-separated (default: both, where the family has a kohya layout that holds "
                   "the LoRA's layers); peft (OUT/<title>_peft/, lora_type lokr and loha, with kohya).",
    "title": "The LoRA's title in its metadata (modelspec.title) and the kohya file's name (default: the output "
             "folder's name).",
}
